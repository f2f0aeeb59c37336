"""`dflash eval`: offline acceptance length on a held-out store, or online speculative decoding.

Offline: `dflash.train.heldout.offline_tau`, the training semantics measured on held-out samples
(docs/DESIGN.md §6).  Online (`dflash.evaluate.online`): real greedy speculative decoding against the target
(dflash.evaluate.speculative) on held-out prompts, timed against target-only greedy decoding and checked
token for token against it.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import sys
import warnings
from pathlib import Path

import torch

from dflash.config import EvalConfig, flat_options
from dflash.durable import atomic_write_bytes
from dflash.errors import ConfigError, DataError, DFlashError
from dflash.evaluate.online import decode_prompts, eos_token_ids, finish_online, online_eval
from dflash.train.heldout import offline_tau

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- online


def prompt_messages(messages: list[dict]) -> list[dict] | None:
    """All turns before the last assistant turn (None when nothing precedes it)."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))
    return messages[:last] or None


def load_prompts(path, tokenizer, max_samples: int | None = None, max_tokens: int | None = None,
                 left_out: list | None = None, rows_used: list | None = None) -> list[list[int]]:
    """Prompt token ids: each conversation's turns before its last assistant turn + generation prompt, the
    first `max_samples` of them that are at most `max_tokens` long.  A longer prompt (a whole multi-turn
    conversation can outgrow the target's context) is left out and the next row taken; each one's
    (row, tokens) is appended to `left_out` and named on stderr.  `rows_used` gets each prompt's row."""
    from dflash.chat import conversation_of, load_rows

    rows = load_rows(path) if max_tokens is not None else load_rows(path, max_samples=max_samples)
    prompts = []
    for i, row in enumerate(rows):
        if max_samples is not None and len(prompts) >= max_samples:
            break
        msgs = prompt_messages(conversation_of(row, i, path))
        if msgs is None:
            continue
        ids = list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"])
        if max_tokens is not None and len(ids) > max_tokens:
            print(f"dflash eval: the prompt of row {i} of {path} is {len(ids):,} tokens, more than the "
                  f"{max_tokens:,} that leave room for --max-new-tokens in the target's context; left out, the "
                  "next row taken instead", file=sys.stderr, flush=True)
            if left_out is not None:
                left_out.append((i, len(ids)))
            continue
        prompts.append(ids)
        if rows_used is not None:
            rows_used.append(i)
    if not prompts:
        raise DataError(f"{path}: no conversation has a turn before its last assistant turn to use as a prompt"
                        + (f" that fits in {max_tokens:,} tokens." if max_tokens is not None else "."))
    return prompts


def prompt_budget(target_dir: str, max_new_tokens: int) -> int | None:
    """The longest prompt that leaves room for `max_new_tokens` in the target's context, or None when the
    target's config names no context length."""
    from dflash.target_model.files import context_length

    limit = context_length(target_dir)
    if limit is None:
        return None
    if max_new_tokens >= limit:
        raise ConfigError(f"--max-new-tokens {max_new_tokens} does not fit the context of target {target_dir} "
                          f"({limit:,} positions); give fewer new tokens.")
    return limit - max_new_tokens


# ---------------------------------------------------------------------------------------------- plumbing


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r} is not a device; use auto, cpu or cuda:N.") from None


def _target_of(cfg: EvalConfig, train_config: dict, ckpt: Path) -> str:
    """--target, else the run's: its path as given to `dflash train`, else the store's resolved one."""
    target = cfg.target
    if not target:
        from dflash.paths import from_record

        given = flat_options(train_config.get("train") or train_config).get("target")  # nested, or flat (older runs)
        # the run's records hold the store relative to the run, and the store its target relative to itself
        run = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt
        store = train_config.get("store") or {}
        store_dir = from_record(store.get("path"), run)
        resolved = from_record((store.get("target") or {}).get("path"), store_dir) if store_dir else None
        resolved = str(resolved) if resolved else None
        target = next((t for t in (given, resolved) if t and Path(t).is_dir()), given or resolved)
    if not target:
        raise ConfigError(
            f"checkpoint {ckpt} does not record its target; pass --target DIR (the target it was trained for)."
        )
    return str(target)


def _check_target(drafter_cfg, identity: dict, target_dir: str) -> None:
    checks = [("hidden size", drafter_cfg.hidden_size, identity.get("hidden_size")),
              ("number of target layers", drafter_cfg.num_target_layers, identity.get("num_hidden_layers")),
              ("vocab size", drafter_cfg.vocab_size, identity.get("vocab_size"))]
    diffs = [f"{n}: drafter expects {a}, target has {b}" for n, a, b in checks if b is not None and a != b]
    if diffs:
        raise ConfigError(f"target {target_dir} does not fit the drafter ({'; '.join(diffs)}); pass the target "
                          "the drafter was trained for with --target.")


def write_outputs(result: dict, out: Path, plots: bool = True) -> None:
    """eval JSON + dvc-friendly tables (acceptance.csv, tau_hist.csv) + PNG plots beside it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    main = result.get("offline") or result.get("online")
    if main is not None:
        _write_tables(main, out.parent)
    atomic_write_bytes(out, (json.dumps(result, indent=2) + "\n").encode(), durable=False)
    if plots:
        from dflash.evaluate.bench_report import plot_bench
        from dflash.evaluate.plots import plot_eval

        if main is not None:
            plot_eval(result, out.parent)
        if result.get("bench"):
            plot_bench(result["bench"], out.parent)


def _write_tables(main: dict, out_dir: Path) -> None:
    B = main["block_size"]
    tables = {"acceptance.csv": [["position", "acceptance"], *([k, round(a, 6)] for k, a in zip(range(1, B), main["acceptance"]))],
              "tau_hist.csv": [["tau", "count"], *([t, c] for t, c in zip(range(1, B + 1), main["tau_hist"]))]}
    for name, rows in tables.items():  # whole or not at all: dvc reads them as metrics and plots
        f = io.StringIO(newline="")
        csv.writer(f).writerows(rows)
        atomic_write_bytes(out_dir / name, f.getvalue().encode(), durable=False)


def _offline(cfg: EvalConfig, drafter, target_dir: str, identity, device: torch.device) -> dict:
    """Offline tau on the held-out store, after checking the store was captured from this target."""
    from dflash.store import compare_manifest, open_store
    from dflash.target_model.files import load_embed_and_head, tokenizer_hash

    store = open_store(cfg.store, require_complete=True)
    compare_manifest(store.manifest, identity, tokenizer_hash(target_dir), drafter.config.target_layer_ids)
    embed, head = load_embed_and_head(target_dir)
    drafter.to(device=device, dtype=torch.float32)
    offline = offline_tau(drafter, embed.float(), head.float(), store, num_anchors=cfg.num_anchors,
                          seed=cfg.seed, max_samples=cfg.max_samples)
    offline["store"] = str(cfg.store)
    if cfg.walk:
        from dflash.train.walk import walk_tau

        offline["walk"] = walk_tau(drafter, embed.float(), head.float(), store, max_new_tokens=cfg.max_new_tokens,
                                   max_samples=cfg.max_samples)
    return offline


class _Target:
    """The target, loaded at most once for every prompt set of the eval (and not at all when --workers
    processes decode everything against a reused reference)."""

    def __init__(self, target_dir: str, dtype: torch.dtype, device: torch.device):
        self.dir, self.dtype, self.device, self._model = target_dir, dtype, device, None

    def __call__(self):
        if self._model is None:
            from dflash.target_model.capture import load_target

            self._model = load_target(self.dir, self.dtype, self.device)
        return self._model


def _decoder(cfg: EvalConfig, drafter, ckpt: Path, target: _Target, tokenizer):
    """decode(prompts, refs, groups) -> records (dflash.evaluate.online.decode_prompts), here or in --workers
    processes.  With --batch-size above 1 the refs are the batched target-only outputs, and each group (a
    prompt set) times --timed-prompts of its prompts alone (dflash.evaluate.prompt_sets)."""
    threshold = cfg.confidence_threshold or None
    if cfg.workers < 1:
        raise ConfigError(f"--workers {cfg.workers}: give 1 or more eval processes.")

    def decode(prompts: list[list[int]], refs: list | None, groups: list[list[int]] | None = None) -> list[dict]:
        from dflash.evaluate.prompt_sets import decode_batched, spread_timed

        spread = refs
        if refs is not None and cfg.batch_size > 1 and not all(g.seconds is not None for g in refs):
            spread = spread_timed(refs, cfg.timed_prompts, groups)
        if cfg.workers > 1:
            from dflash.evaluate.workers import run_workers

            job = {"checkpoint": str(ckpt), "target": target.dir, "device": str(target.device), "dtype": cfg.dtype,
                   "max_new_tokens": cfg.max_new_tokens, "confidence_threshold": threshold, "seed": cfg.seed}
            return run_workers(job, prompts, spread, cfg.workers)
        from tqdm import tqdm

        from dflash.evaluate.batched_speculative import supports_batching

        model = target()
        drafter.to(device=target.device, dtype=target.dtype)
        eos = eos_token_ids(model, tokenizer)
        bar = tqdm(total=len(prompts), desc="speculative decoding", unit="prompt")

        def single(some: list[list[int]], some_refs: list | None) -> list[dict]:
            return decode_prompts(model, drafter, some, some_refs, max_new_tokens=cfg.max_new_tokens, eos_ids=eos,
                                  confidence_threshold=threshold, on_prompt=bar.update)

        confident = threshold is not None and getattr(drafter, "confidence_head", None) is not None
        if cfg.batch_size > 1 and refs is not None and supports_batching(model, drafter, confident):
            bar.total += sum(min(cfg.timed_prompts, len(g)) for g in (groups or [prompts]))  # decoded again alone
            records = decode_batched(model, drafter, prompts, refs, single, max_new_tokens=cfg.max_new_tokens,
                                     eos_ids=eos, batch_size=cfg.batch_size, timed=cfg.timed_prompts, groups=groups,
                                     progress=bar.update)
        else:
            records = single(prompts, spread)
        bar.close()
        return records

    return decode


def _online(cfg: EvalConfig, drafter, decode, target: _Target, tokenizer, identity) -> dict:
    """Online speculative decoding of the held-out prompts, against a batched, reused or per-prompt reference."""
    left_out: list = []
    rows: list = []
    prompts = load_prompts(cfg.prompts, tokenizer, cfg.max_samples, prompt_budget(target.dir, cfg.max_new_tokens),
                           left_out, rows)
    reference = None
    if cfg.reference:
        from dflash.evaluate.reference import ReferenceFile

        reference = ReferenceFile(cfg.reference, identity, prompts, cfg.max_new_tokens, cfg.dtype, target.device.type)
    refs = reference.load() if reference is not None else None
    reused = refs is not None
    disagree: list[int] = []
    batched = None
    if refs is None and cfg.batch_size > 1:
        from tqdm import tqdm

        from dflash.evaluate.prompt_sets import batch_disagreements, reference_decode

        model = target()
        with tqdm(total=len(prompts), desc="target-only reference", unit="prompt") as bar:
            batched = reference_decode(model, prompts, max_new_tokens=cfg.max_new_tokens,
                                       eos_ids=eos_token_ids(model, tokenizer), batch_size=cfg.batch_size,
                                       progress=bar.update)
        refs = batched
    records = decode(prompts, refs)
    if batched is not None:
        disagree = batch_disagreements(records, batched)
    online = finish_online(records, drafter.config.block_size, cfg.confidence_threshold or None, reference, reused)
    for rec, row in zip(online["per_prompt"], rows):
        rec["row"] = row  # the prompt's row in --prompts
    online.update(prompts=str(cfg.prompts), dtype=cfg.dtype, device=str(target.device), prompts_left_out=len(left_out))
    if batched is not None:
        online.update(reference_batch_size=cfg.batch_size, batched_reference_differs=disagree)
    return online


def _bench_sets(cfg: EvalConfig) -> dict:
    """The questions of each --bench prompt set, fetched (or refused) before anything is decoded."""
    from dflash.evaluate.bench import bench_names, cache_dir, load_bench

    cache = cache_dir(cfg.bench_cache)
    return {name: load_bench(name, cache) for name in bench_names(cfg.bench)}


def _benches(cfg: EvalConfig, sets: dict, drafter, decode, target: _Target, tokenizer, identity) -> dict:
    """The standard prompt sets (--bench), every turn against the target-only reference, per category."""
    from tqdm import tqdm

    from dflash.evaluate.bench import BENCHES
    from dflash.evaluate.prompt_sets import run_benches

    reference = None
    if cfg.reference:
        from dflash.evaluate.reference import ReferenceFile, bench_path

        questions = [[name, q.id, *q.turns] for name, items in sets.items() for q in items]
        reference = ReferenceFile(bench_path(cfg.reference), identity, questions, cfg.max_new_tokens, cfg.dtype,
                                  target.device.type, one_per_prompt=False)
    model = target()
    turns = sum(len(q.turns) for items in sets.values() for q in items)
    with tqdm(total=turns, desc=f"target-only reference ({', '.join(sets)})", unit="prompt") as bar:
        out = run_benches(model, tokenizer, sets, decode, block_size=drafter.config.block_size,
                          max_new_tokens=cfg.max_new_tokens, eos_ids=eos_token_ids(model, tokenizer),
                          batch_size=cfg.batch_size, budget=prompt_budget(target.dir, cfg.max_new_tokens),
                          progress=bar.update, reference=reference)
    for name, s in out.items():
        spec = BENCHES[name]
        s.update(package=f"{spec.package}=={spec.version}", file=spec.member, sha256=spec.sha256,
                 dtype=cfg.dtype, device=str(target.device), reference_batch_size=cfg.batch_size)
    return out


def _lossless_failure(name: str, s: dict) -> str:
    return (f"speculative decoding differs from target-only greedy decoding on {len(s['mismatches'])} of "
            f"{s['num_prompts']} prompt(s) of {name} (first: {s['mismatches'][0]}); see 'mismatches' in the eval JSON.")


def run_eval(cfg: EvalConfig) -> dict:
    """`dflash eval`: offline tau (--store) and/or online speculative decoding (--prompts)."""
    from dflash.evaluate.export import load_training_drafter
    from dflash.target_model.files import target_identity

    if not cfg.run:
        raise ConfigError("give --run RUN (a training run directory or one of its checkpoints).")
    if not cfg.store and not cfg.prompts and not cfg.bench:
        raise ConfigError("give --store HELDOUT_STORE (offline tau), --prompts PATH and/or --bench SETS (online "
                          "decoding).")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if cfg.dtype not in dtypes:
        raise ConfigError(f"eval dtype {cfg.dtype!r} is not one of fp32, bf16.")
    device = _device(cfg.device)
    sets = _bench_sets(cfg) if cfg.bench else {}  # a wrong name or an unreachable index: before any loading
    drafter, ckpt, train_config = load_training_drafter(cfg.run)
    target_dir = _target_of(cfg, train_config, ckpt)
    identity = target_identity(target_dir)
    _check_target(drafter.config, identity, target_dir)
    torch.manual_seed(cfg.seed)
    result: dict = {"checkpoint": str(ckpt), "target": target_dir}
    lossless_failure = None

    if cfg.store:
        result["offline"] = _offline(cfg, drafter, target_dir, identity, device)
    if cfg.prompts or cfg.bench:
        from dflash.target_model.capture import load_tokenizer

        target = _Target(target_dir, dtypes[cfg.dtype], device)
        tokenizer = load_tokenizer(target_dir)
        decode = _decoder(cfg, drafter, ckpt, target, tokenizer)
        failures = []
        if cfg.prompts:
            online = _online(cfg, drafter, decode, target, tokenizer, identity)
            result["online"] = online
            result["lossless"] = online["lossless"] and (online.get("confidence") or {}).get("lossless", True)
            if "confidence" in online:
                result["tau_confidence"] = online["confidence"]["tau"]
            result["speedup"] = online["speedup"]
            if not online["lossless"]:
                failures.append(_lossless_failure(str(cfg.prompts), online))
        if cfg.bench:
            result["bench"] = _benches(cfg, sets, drafter, decode, target, tokenizer, identity)
            result["lossless"] = result.get("lossless", True) and all(s["lossless"] for s in result["bench"].values())
            failures += [_lossless_failure(n, s) for n, s in result["bench"].items() if not s["lossless"]]
        lossless_failure = " ".join(failures) or None
    main = result.get("offline") or result.get("online") or next(iter(result["bench"].values()))
    result["tau"] = main["tau"]

    out = Path(cfg.out) if cfg.out else (Path(cfg.run) if not (Path(cfg.run) / "model.safetensors").is_file()
                                         else ckpt.parent.parent) / "eval.json"
    plots = cfg.plots
    if plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            warnings.warn("matplotlib is not installed: skipping the eval plots (pip install 'dflash[plots]').")
            plots = False
    write_outputs(result, out, plots=plots)
    result["out"] = str(out)
    if lossless_failure:
        if cfg.dtype == "fp32":  # in fp32 only a bug makes the outputs part
            raise DFlashError(lossless_failure + " In fp32 this is a bug in dflash; please report it.")
        warnings.warn(lossless_failure + f" In {cfg.dtype}, a logit_margin near 0 means a near-tie that low "
                      "precision rounds differently between one-token and block forwards; rerun with dtype fp32.")
    return result


__all__ = ["offline_tau", "online_eval", "load_prompts", "run_eval", "write_outputs"]
