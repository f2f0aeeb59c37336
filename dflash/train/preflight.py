"""Everything a training run checks and resolves before it touches a GPU or writes a file.

`preflight(cfg)` opens the store (index only), refuses a store that does not match the target or the
drafter, picks the mask token, builds the drafter config and the loader spec, and returns them as a
`ResolvedRun` (dflash.train.resolved).  It runs once per run, in the launcher (or rank 0 under torchrun),
so that user errors cost one message, not one traceback per process, and the mask token is chosen once
(it may scan the store); the training processes receive the result.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

from dflash.config import TrainConfig
from dflash.drafter import family
from dflash.errors import ConfigError, DFlashError, StoreError
from dflash.jsonl import jsonl_lines
from dflash.paths import portable
from dflash.train.epochs import wait_for_manifest
from dflash.train.loader import LoaderSpec
from dflash.train.resolved import ResolvedRun


def _run_dir_in_use(out: Path) -> bool:
    return out.exists() and (not out.is_dir() or any(out.iterdir()))


def check_run_dir(cfg: TrainConfig) -> None:
    out = Path(cfg.job.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; pass a directory for the run.")
    if _run_dir_in_use(out) and not (cfg.checkpoint.resume or cfg.checkpoint.overwrite):
        raise ConfigError(
            f"run directory {out} already exists and is not empty; pass --resume to continue it, "
            "--overwrite to delete it and start over, or another --out."
        )
    if cfg.checkpoint.overwrite and _run_dir_in_use(out) and not is_run_dir(out):
        raise ConfigError(
            f"--overwrite would delete {out}, but it is not a dflash run directory (no metrics.jsonl, "
            "checkpoints/ or run config.json) nor an empty directory. Refusing to delete it: remove it yourself "
            "if it is yours to delete, or choose another --out."
        )


def is_run_dir(out: Path) -> bool:
    """A directory `dflash train` wrote: metrics.jsonl, checkpoints/, or a config.json holding a run record."""
    if out.is_symlink() or not out.is_dir():
        return False
    if (out / "metrics.jsonl").is_file() or (out / "checkpoints").is_dir():
        return True
    try:
        record = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and isinstance(record.get("train"), dict)


def prepare_run_dir(cfg: TrainConfig) -> None:
    """Rank 0, before any other process writes: apply --overwrite, create the directory, drop debris."""
    from dflash.train.checkpoint import clean_partial

    out = Path(cfg.job.out)
    check_run_dir(cfg)
    if cfg.checkpoint.overwrite and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    clean_partial(out)


def truncate_metrics(path: Path, last_step: int) -> list[dict]:
    """Keep the records of steps <= last_step (a killed run may have logged past its checkpoint)."""
    if not path.is_file():
        return []
    kept = []
    for line in jsonl_lines(path.read_text(encoding="utf-8")):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line torn by the kill
            continue
        if rec.get("step", 0) <= last_step:
            kept.append(rec)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)
    return kept


def resolve_mask_token(cfg_id: int | None, target: str, vocab_rows: int, store,
                       growing: bool = False) -> tuple[int, str]:
    """(mask token id, how it was chosen: the token's text and the rule), by the rule of docs/DESIGN.md §2.

    In order: the configured id; the tokenizer's own mask token; the first embedding row past the
    tokenizer (a padding row no text can produce, as z-lab uses for Qwen3); then an added special token
    that never occurs in the store (`_special_candidates`).  Never an in-use word: with none of these,
    the user must choose.
    """
    if cfg_id is not None:
        if not 0 <= cfg_id < vocab_rows:
            raise ConfigError(f"--mask-token-id {cfg_id} is outside the target's embedding table (0..{vocab_rows - 1}).")
        return int(cfg_id), "configured"
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(target)
    except Exception as e:  # noqa: BLE001 - transformers raises many types
        raise ConfigError(f"cannot load the tokenizer of {target} to pick a mask token ({e}); pass --mask-token-id.") from None
    if tok.mask_token_id is not None and tok.mask_token_id < vocab_rows:
        return int(tok.mask_token_id), f"tokenizer mask token {tok.mask_token!r}"
    if len(tok) < vocab_rows:
        return len(tok), "first unused embedding row"
    cands = _special_candidates(tok, vocab_rows)
    if cands and growing:
        i, rule = cands[0]
        raise ConfigError(
            f"the target {target} has no mask token and no unused embedding row, and a special token can be "
            "chosen only by scanning a finished store (--follow trains from one being written); pass "
            f"--mask-token-id, e.g. {i} ({tok.convert_ids_to_tokens(i)!r}, a {rule}), if the data never uses it."
        )
    used = _ids_in_store(store, {i for i, _ in cands}) if cands else set()
    for i, rule in cands:
        if i not in used:
            return i, f"{rule} {tok.convert_ids_to_tokens(i)!r}, absent from the store"
    raise ConfigError(
        f"the target {target} has no spare token for the drafter's mask (no mask token, no unused embedding "
        "row, no added special token that the chat template and the store leave unused); pass "
        "--mask-token-id with an id that never occurs in the data."
    )


def _special_candidates(tok, vocab_rows: int) -> list[tuple[int, str]]:
    """Added special tokens that may mask, in order, each group by lowest id: mask-named, reserved-named,
    then any other but bos/eos/pad/unk and those the chat template writes (tokens such as SmolLM2's code
    markers <filename>, <gh_stars>, which chat data never holds).  The store is checked by the caller."""
    core = {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id}
    in_template = _template_ids(tok)
    groups: tuple[list, list, list] = ([], [], [])
    for i, t in sorted(tok.added_tokens_decoder.items()):
        if not t.special or not 0 <= i < vocab_rows:
            continue
        name = t.content.lower()
        if "mask" in name:
            groups[0].append((i, "mask-named special token"))
        elif "reserved" in name:
            groups[1].append((i, "reserved special token"))
        elif i not in core and i not in in_template:
            groups[2].append((i, "added special token unused by the chat template"))
    return [c for g in groups for c in g]


def _template_ids(tok) -> set[int]:
    """Ids of the added tokens the chat template writes: named in its source, or in a render of a short
    conversation (tokens it reaches through variables such as bos_token)."""
    src = tok.chat_template or ""
    src = " ".join(src.values()) if isinstance(src, dict) else str(src)
    ids = {i for i, t in tok.added_tokens_decoder.items() if t.content in src}
    if src:
        probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                 {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}]
        try:
            text = tok.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
            ids.update(tok(text, add_special_tokens=False)["input_ids"])
        except Exception:  # noqa: BLE001 - a template may refuse the probe; its source was read above
            pass
    return ids


def _ids_in_store(store, ids: set[int]) -> set[int]:
    """Which of `ids` occur anywhere in the store's committed tokens (read shard by shard, in big slices)."""
    import numpy as np
    from tqdm import tqdm

    want = np.array(sorted(ids))
    seen: set[int] = set()
    total = sum(int(sh.end) for sh in store.shards)
    step = 1 << 22
    with tqdm(total=total, desc="checking mask token candidates", unit="tok", unit_scale=True, leave=False) as bar:
        for sh in store.shards:
            for lo in range(0, int(sh.end), step):
                hi = min(int(sh.end), lo + step)
                seen.update(int(v) for v in want[np.isin(want, sh.rows("input_ids", lo, hi))])
                bar.update(hi - lo)
    return seen


# The drafters published for Qwen3.5/3.6 (hybrid) targets: sliding-window layers, then one full layer
# (Qwen3.6-27B's: four sliding, window 2048, one full; docs/DESIGN.md §4).
HYBRID_QWEN_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text")
HYBRID_QWEN_WINDOW = 2048


def _is_hybrid_qwen(target_cfg) -> bool:
    text = target_cfg.get_text_config() if hasattr(target_cfg, "get_text_config") else target_cfg
    return bool({getattr(target_cfg, "model_type", None), getattr(text, "model_type", None)} & set(HYBRID_QWEN_TYPES))


def _layer_types(cfg: TrainConfig, target_cfg=None) -> tuple[list[str] | None, int | None, str]:
    """--layer-types / --sliding-window, checked: one of full/sliding per drafter layer, a window exactly
    when some layer slides (docs/DESIGN.md §4); unset on a Qwen3.5/3.6 target, the layout its published
    drafters have.  Also says where the choice came from (the start-up line and RUN/config.json)."""
    types, window = cfg.drafter.layer_types, cfg.drafter.sliding_window
    source = "--layer-types" if types is not None else "default: all full"
    if types is None and target_cfg is not None and _is_hybrid_qwen(target_cfg) and cfg.drafter.num_layers > 1:
        types = ["sliding"] * (cfg.drafter.num_layers - 1) + ["full"]
        window = window or HYBRID_QWEN_WINDOW
        source = (f"default for Qwen3.5/3.6 targets, as their published drafters: {cfg.drafter.num_layers - 1} sliding "
                  f"(window {window}) then 1 full; --layer-types full{',full' * (cfg.drafter.num_layers - 1)} opts out")
    if types is not None:
        bad = [t for t in types if t not in ("full", "sliding")]
        if bad or len(types) != cfg.drafter.num_layers:
            raise ConfigError(f"--layer-types {','.join(types)} must give full or sliding for each of the "
                              f"{cfg.drafter.num_layers} drafter layers (--num-layers), e.g. "
                              f"{','.join(['sliding'] * (cfg.drafter.num_layers - 1) + ['full'])}.")
    sliding = "sliding" in (types or ())
    if sliding and (window is None or window < 1):
        raise ConfigError("--layer-types has sliding layers: pass --sliding-window W (keys at most W positions "
                          "back, the query's own token included), e.g. --sliding-window 2048.")
    if window is not None and not sliding:
        raise ConfigError(f"--sliding-window {window} without a sliding layer in --layer-types does nothing; "
                          "pass --layer-types with sliding layers, or leave the window out.")
    return types, window, source


def _drafter_config(dcfg, cfg: TrainConfig):
    """The drafter config of the run's family (--arch and its option section) from the DFlash one derived
    from the target; a ConfigError for a choice that cannot train."""
    fam = family(cfg.drafter.arch)  # a name of the registry: TrainConfig checked its choices
    if fam.heads_outside_forward and cfg.systems.parallel == "fsdp":
        raise ConfigError(f"--arch {fam.name} trains its heads outside the drafter's forward, which FSDP2 does "
                          "not unshard; use --parallel ddp (the heads are small beside the layers).")
    try:
        return fam.config_for(dcfg, fam.section(cfg))
    except ValueError as e:
        raise ConfigError(f"--arch {fam.name} cannot be built on this target: {e}; change the {fam.name} option "
                          f"({', '.join('--' + k.replace('_', '-') for k in fam.knobs)}).") from None


def _checked_store(cfg: TrainConfig, identity: dict):
    """The training store, checked against the target and the options; the held-out store's manifest too."""
    from dflash.store import compare_manifest, open_store
    from dflash.target_model.files import tokenizer_hash

    if cfg.stream.follow:
        wait_for_manifest(cfg)
    store = open_store(cfg.job.store, require_complete=not cfg.stream.follow)
    compare_manifest(store.manifest, identity, tokenizer_hash(cfg.job.target), target_layer_ids=cfg.drafter.target_layers)
    if len(store) == 0 and not cfg.stream.follow:
        raise StoreError(f"store {cfg.job.store} has no committed samples; run or finish `dflash precompute` first.")
    if cfg.objective.kd_weight > 0 and not store.topk:
        raise ConfigError(f"--kd-weight {cfg.objective.kd_weight} needs top-k target log-probs, but store {cfg.job.store} "
                          "was made with --topk 0; precompute with --topk K or train with --kd-weight 0.")
    if cfg.data.labels in ("target", "rollout") and not store.topk:
        raise ConfigError(f"--labels {cfg.data.labels} trains on the target's greedy tokens, its stored top-1, but store "
                          f"{cfg.job.store} was made with --topk 0; precompute with --topk K (8 is the default) or "
                          "train with --labels data.")
    family(cfg.drafter.arch).check(cfg, store)  # what the drafter family needs of the store
    if cfg.monitor.eval_every:
        if not cfg.monitor.eval_store:
            raise ConfigError("--eval-every needs --eval-store, a held-out store precomputed from the same target.")
        eval_store = open_store(cfg.monitor.eval_store, require_complete=True)
        compare_manifest(eval_store.manifest, identity, tokenizer_hash(cfg.job.target),
                         target_layer_ids=store.target_layer_ids)
    return store


def _store_record(cfg: TrainConfig, store) -> dict:
    m = store.manifest
    return {
        "path": portable(cfg.job.store, cfg.job.out),  # relative to the run directory
        "samples": len(store),
        **{k: m.get(k) for k in ("format_version", "target", "tokenizer_hash", "dataset_fingerprint",
                                 "target_layer_ids", "hidden_dtype", "topk", "max_length")},
    }


def preflight(cfg: TrainConfig) -> ResolvedRun:
    from dflash.drafter import DrafterConfig
    from dflash.target_model.files import engine_layer_problem, target_config, target_identity

    cfg.check()  # each section's rules (dflash/config/train.py); choices were checked when cfg was built
    check_run_dir(cfg)
    identity = target_identity(cfg.job.target)
    store = _checked_store(cfg, identity)
    vocab_rows = int(identity.get("vocab_size") or 0)
    mask_id, source = resolve_mask_token(cfg.drafter.mask_token_id, cfg.job.target, vocab_rows, store, growing=cfg.stream.follow)
    tcfg = target_config(cfg.job.target)
    types, window, types_source = _layer_types(cfg, tcfg)
    dcfg = DrafterConfig.from_target(tcfg, cfg.drafter.num_layers, cfg.drafter.block_size, list(store.target_layer_ids), mask_id,
                                     types, window)
    dcfg = _drafter_config(dcfg, cfg)
    problem = engine_layer_problem(dcfg.target_layer_ids, dcfg.num_target_layers)
    if problem:  # it would train, but vLLM / SGLang could not serve the export (docs/DESIGN.md §2)
        raise ConfigError(f"store {cfg.job.store} cannot train a drafter the engines can serve: {problem}")
    if dcfg.hidden_size * len(dcfg.target_layer_ids) != store.hidden_size * len(store.target_layer_ids):
        raise StoreError(f"store {cfg.job.store} holds features of width {store.hidden_size} x "
                         f"{len(store.target_layer_ids)} layers, but the drafter expects hidden size {dcfg.hidden_size}.")
    init = None
    if cfg.drafter.drafter_init == "target":
        from dflash.train import drafter_init

        init = drafter_init.plan(cfg.job.target, dcfg, tcfg)
    scale = None
    if cfg.drafter.context_scale == "rms" and _fresh(cfg):  # a resumed run keeps its checkpoint's
        from dflash.train import context_scale

        scale = context_scale.compute(store)
    fam = family(cfg.drafter.arch)
    needs = fam.needs(fam.section(cfg))  # what the family reads beyond features and labels
    spec = LoaderSpec(
        block_size=cfg.drafter.block_size,
        num_anchors=cfg.data.num_anchors,
        token_budget=cfg.data.token_budget,
        block_budget=cfg.data.block_budget or cfg.data.token_budget,
        rows_per_batch=cfg.data.rows_per_batch,
        mask_token_id=mask_id,
        gamma=cfg.objective.gamma,
        seed=cfg.job.seed,
        num_shapes=cfg.data.num_shapes,
        kd=cfg.objective.kd_weight > 0 or needs.topk,
        target_labels=cfg.data.labels in ("target", "rollout"),
        rollout_labels=cfg.data.labels == "rollout",
        final_hidden=needs.final_hidden,
        skip_damaged=cfg.data.skip_damaged,
        sliding_window=dcfg.sliding_window if dcfg.has_sliding else None,
    )
    return ResolvedRun(dataclasses.replace(cfg, drafter=dataclasses.replace(cfg.drafter, mask_token_id=mask_id)), dcfg, spec, mask_id, source, types_source,
                       store.hidden_size * store.num_layers, _store_record(cfg, store), init, scale)


def _fresh(cfg: TrainConfig) -> bool:
    """Whether the run starts from scratch (no --resume, or nothing to resume yet); with checkpoints to
    resume, the trainer loads the newest readable one or refuses."""
    from dflash.train.checkpoint import list_checkpoints

    return not (cfg.checkpoint.resume and list_checkpoints(cfg.job.out))


def resolved_by_rank0(cfg: TrainConfig, rank: int, world: int) -> ResolvedRun:
    """Under torchrun: rank 0's preflight, broadcast to every rank (its error raised on every rank)."""
    import torch.distributed as dist

    if world <= 1:
        return preflight(cfg)
    box: list = [None]
    failure = None
    if rank == 0:
        try:
            box[0] = preflight(cfg)
        except DFlashError as e:
            box[0] = failure = e
        except Exception as e:  # a bug: the others stop too; rank 0 keeps the traceback
            box[0], failure = RuntimeError(f"rank 0's preflight failed: {e!r}"), e
    dist.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


__all__ = ["preflight", "resolved_by_rank0", "prepare_run_dir", "check_run_dir", "truncate_metrics", "resolve_mask_token"]
