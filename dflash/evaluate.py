"""Measuring a drafter: offline acceptance length on a held-out store, online speculative decoding.

Offline (`offline_tau`): the training semantics exactly (DESIGN section 3): the loader draws anchors
from each held-out sample (seeded, so two evaluations of two checkpoints see the same blocks), the
drafter predicts every block in one packed forward, and a block's acceptance length is 1 + the number
of leading positions whose greedy prediction equals the stored token (a position past the sample or
not supervised ends the run).  Cheap enough to run from `dflash train --eval-every`.

Online (`online_eval`): real greedy speculative decoding against the target (dflash.speculative) on
held-out prompts, timed against target-only greedy decoding, and checked token for token against it.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from dflash.config import EvalConfig
from dflash.errors import ConfigError, DataError, DFlashError, StoreError
from dflash.loss import IGNORE, block_acceptance

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- offline


def _greedy(hidden: torch.Tensor, lm_head: torch.Tensor, labels: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """argmax of the target lm_head, computed only where there is a label, a chunk at a time."""
    flat = labels.reshape(-1)
    sel = (flat != IGNORE).nonzero().squeeze(1)
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, sel)
    preds = torch.full_like(flat, -1)
    out = torch.empty(len(sel), dtype=torch.long, device=hidden.device)
    for i in range(0, len(sel), chunk):
        out[i : i + chunk] = (h[i : i + chunk].to(lm_head.dtype) @ lm_head.t()).argmax(-1)
    preds[sel] = out
    return preds.view_as(labels)


def summarize(taus: np.ndarray, block_size: int, correct: np.ndarray | None = None,
              valid: np.ndarray | None = None) -> dict:
    """tau statistics: mean, histogram over 1..B, and P(position k accepted) for k = 1..B-1."""
    B = block_size
    taus = np.asarray(taus, dtype=np.int64)
    n = max(len(taus), 1)
    hist = np.bincount(taus, minlength=B + 1)[1 : B + 1]
    out = {
        "tau": float(taus.mean()) if len(taus) else float("nan"),
        "num_blocks": int(len(taus)),
        "block_size": B,
        # acceptance[k-1]: share of blocks whose first k proposals were all accepted
        "acceptance": [float((taus >= k + 1).sum() / n) for k in range(1, B)],
        "tau_hist": [int(c) for c in hist],
    }
    if correct is not None:
        out["accuracy"] = [float(c / v) if v else None for c, v in zip(correct[1:], valid[1:])]
    return out


@torch.no_grad()
def offline_tau(drafter, embed: torch.Tensor, lm_head: torch.Tensor, store, *, num_anchors: int = 64,
                seed: int = 0, max_samples: int | None = None, token_budget: int | None = None,
                block_budget: int | None = None, progress: bool = True) -> dict:
    """Greedy acceptance length of `drafter` on a held-out store (DESIGN section 3 semantics).

    embed / lm_head: the target's frozen [V, H] tensors (they are moved to the drafter's device).
    Anchors come from dflash.loader with (seed, epoch 0): the same blocks for every checkpoint.
    Returns {tau, num_blocks, num_samples, block_size, acceptance [B-1], accuracy [B-1], tau_hist [B]}.
    """
    from dflash import loader as L
    from dflash import masks

    cfg = drafter.config
    B = cfg.block_size
    if store.hidden_size != cfg.hidden_size or list(store.target_layer_ids) != list(cfg.target_layer_ids):
        raise StoreError(
            f"store {store.path} holds target layers {store.target_layer_ids} of hidden size {store.hidden_size}, "
            f"but the drafter reads layers {cfg.target_layer_ids} of hidden size {cfg.hidden_size}; evaluate on "
            "a held-out store precomputed from the same target with the same --target-layers."
        )
    if len(store) == 0:
        raise StoreError(f"store {store.path} has no committed samples; run `dflash precompute` to completion.")
    param = next(drafter.parameters())
    device = param.device
    longest = int(store.lengths().max())
    # Whole samples as context (no truncation) unless the caller fixes the shapes (a compiled drafter).
    spec = L.LoaderSpec(
        block_size=B,
        num_anchors=num_anchors,
        token_budget=token_budget or L.round_up(longest),
        block_budget=block_budget or L.round_up(num_anchors * B),
        rows_per_batch=1,
        mask_token_id=cfg.mask_token_id,
        seed=seed,
    )
    ds = L.PackedDataset(store, spec)
    plan = ds.plan(0)
    embed = embed.to(device)
    lm_head = lm_head.to(device)
    taus, rights, valids, n_samples = [], [], [], 0
    was_training = drafter.training
    drafter.eval()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    bar = tqdm(plan.batches, desc="offline tau", unit="batch", disable=not progress, leave=False)
    try:
        for rows in bar:
            if max_samples is not None:  # a prefix of the (seeded) plan, cut at exactly max_samples
                rows = [r[: max(0, max_samples - n_samples - sum(len(x) for x in rows[:i]))]
                        for i, r in enumerate(rows)]
                rows = [r for r in rows if len(r)]
                if not rows:
                    break
            b = ds.build(0, rows)
            n_samples += int(b["num_samples"])
            meta = {k: v.to(device) for k, v in b["mask"].items()}
            # CPU: the dense mask through SDPA (eager flex_attention there is a slow reference).
            mask = masks.to_block_mask(meta) if device.type == "cuda" else masks.to_dense_mask(meta)
            with autocast:
                hidden = drafter(
                    b["ctx_hidden"].to(device),
                    F.embedding(b["block_input_ids"].to(device), embed),
                    b["ctx_positions"].to(device),
                    b["block_positions"].to(device),
                    mask,
                )
            labels = b["labels"].to(device)
            tau, right, valid = block_acceptance(_greedy(hidden, lm_head, labels), labels, B)
            taus.append(tau.cpu())
            rights.append(right.sum(0).cpu())
            valids.append(valid.sum(0).cpu())
            bar.set_postfix(tau=f"{float(torch.cat(taus).float().mean()):.3f}")
    finally:
        drafter.train(was_training)
    all_tau = torch.cat(taus).numpy() if taus else np.zeros(0, np.int64)
    out = summarize(all_tau, B, torch.stack(rights).sum(0).numpy(), torch.stack(valids).sum(0).numpy())
    out["num_samples"] = n_samples
    return out


# ---------------------------------------------------------------------------------------------- online


def prompt_messages(messages: list[dict]) -> list[dict] | None:
    """All turns before the last assistant turn (None when nothing precedes it)."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))
    return messages[:last] or None


def load_prompts(path, tokenizer, max_samples: int | None = None) -> list[list[int]]:
    """Prompt token ids: each conversation's turns before its last assistant turn + generation prompt."""
    from dflash.data import conversation_of, load_rows

    rows = load_rows(path, max_samples=max_samples)
    prompts = []
    for i, row in enumerate(rows):
        msgs = prompt_messages(conversation_of(row, i, path))
        if msgs is None:
            continue
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)
        prompts.append(list(ids["input_ids"]))
    if not prompts:
        raise DataError(f"{path}: no conversation has a turn before its last assistant turn to use as a prompt.")
    return prompts


def eos_token_ids(target, tokenizer) -> set[int]:
    ids = set()
    for src in (getattr(target, "generation_config", None), target.config, tokenizer):
        e = getattr(src, "eos_token_id", None)
        ids.update([e] if isinstance(e, int) else list(e or []))
    return ids


def _margin(target, prompt: torch.Tensor, ref: list[int], got: list[int], at: int) -> float | None:
    """The target's logit gap, in one fresh forward, between the two tokens where the outputs part:
    a gap at rounding level says "near-tie under low precision", a clear gap says "bug"."""
    if at >= min(len(ref), len(got)):
        return None
    ids = torch.cat([prompt, prompt.new_tensor(ref[:at])]).view(1, -1)
    logits = target(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
    return float(logits[ref[at]] - logits[got[at]])


@torch.no_grad()
def online_eval(target, drafter, prompts: list[list[int]], *, max_new_tokens: int, eos_ids: set[int],
                propose=None, progress: bool = True) -> dict:
    """Speculative vs target-only greedy decoding on `prompts`: tau, tokens/s, token-for-token equality."""
    from dflash.speculative import greedy_generate, speculative_generate

    device = next(target.parameters()).device
    as_ids = [torch.tensor(p, dtype=torch.long, device=device) for p in prompts]
    # Warm-up (kernels, allocator, lazy inits) so that neither side pays it inside the timing.
    greedy_generate(target, as_ids[0], min(8, max_new_tokens), eos_ids)
    speculative_generate(target, drafter, as_ids[0], min(8, max_new_tokens), eos_ids, propose=propose)
    taus: list[int] = []
    base_s = spec_s = 0.0
    base_n = spec_n = 0
    mismatches = []
    for i, ids in enumerate(tqdm(as_ids, desc="speculative decoding", unit="prompt", disable=not progress)):
        ref = greedy_generate(target, ids, max_new_tokens, eos_ids)
        got = speculative_generate(target, drafter, ids, max_new_tokens, eos_ids, propose=propose)
        base_s, base_n = base_s + ref.seconds, base_n + len(ref.tokens)
        spec_s, spec_n = spec_s + got.seconds, spec_n + len(got.tokens)
        taus += got.acceptance
        if got.tokens != ref.tokens:
            at = next((j for j, (a, b) in enumerate(zip(got.tokens, ref.tokens)) if a != b),
                      min(len(got.tokens), len(ref.tokens)))
            mismatches.append({"prompt": i, "first_difference": at, "target_only": ref.tokens[at : at + 8],
                               "speculative": got.tokens[at : at + 8],
                               "logit_margin": _margin(target, ids, ref.tokens, got.tokens, at)})
    B = drafter.config.block_size
    out = summarize(np.asarray(taus), B)
    base_tps, spec_tps = base_n / max(base_s, 1e-9), spec_n / max(spec_s, 1e-9)
    out.update(
        lossless=not mismatches,
        mismatches=mismatches,
        num_prompts=len(prompts),
        new_tokens=spec_n,
        tokens_per_s_target=base_tps,
        tokens_per_s_speculative=spec_tps,
        speedup=spec_tps / base_tps if base_tps else None,
        tokens_per_target_forward=spec_n / max(len(taus) + len(prompts), 1),
    )
    return out


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
        given = (train_config.get("train") or train_config).get("target")
        resolved = ((train_config.get("store") or {}).get("target") or {}).get("path")
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
    B = main["block_size"]
    with open(out.parent / "acceptance.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["position", "acceptance"])
        w.writerows([k, round(a, 6)] for k, a in zip(range(1, B), main["acceptance"]))
    with open(out.parent / "tau_hist.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["tau", "count"])
        w.writerows([t, c] for t, c in zip(range(1, B + 1), main["tau_hist"]))
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, out)
    if plots:
        from dflash.plots import plot_eval

        plot_eval(result, out.parent)


def run_eval(cfg: EvalConfig) -> dict:
    """`dflash eval`: offline tau (--store) and/or online speculative decoding (--prompts)."""
    from dflash.export import load_training_drafter
    from dflash.target_io import load_embed_and_head, target_identity

    if not cfg.run:
        raise ConfigError("give --run RUN (a training run directory or one of its checkpoints).")
    if not cfg.store and not cfg.prompts:
        raise ConfigError("give --store HELDOUT_STORE (offline tau) and/or --prompts PATH (online decoding).")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if cfg.dtype not in dtypes:
        raise ConfigError(f"eval dtype {cfg.dtype!r} is not one of fp32, bf16.")
    device = _device(cfg.device)
    drafter, ckpt, train_config = load_training_drafter(cfg.run)
    target_dir = _target_of(cfg, train_config, ckpt)
    identity = target_identity(target_dir)
    _check_target(drafter.config, identity, target_dir)
    torch.manual_seed(cfg.seed)
    result: dict = {"checkpoint": str(ckpt), "target": target_dir}
    lossless_failure = None

    if cfg.store:
        from dflash.store import compare_manifest, open_store
        from dflash.target_io import tokenizer_hash

        store = open_store(cfg.store)
        compare_manifest(store.manifest, identity, tokenizer_hash(target_dir), drafter.config.target_layer_ids)
        embed, head = load_embed_and_head(target_dir)
        drafter.to(device=device, dtype=torch.float32)
        result["offline"] = offline_tau(drafter, embed.float(), head.float(), store, num_anchors=cfg.num_anchors,
                                        seed=cfg.seed, max_samples=cfg.max_samples)
        result["offline"]["store"] = str(cfg.store)
    if cfg.prompts:
        from dflash.target import load_target, load_tokenizer

        dtype = dtypes[cfg.dtype]
        tokenizer = load_tokenizer(target_dir)
        target = load_target(target_dir, dtype, device)
        drafter.to(device=device, dtype=dtype)
        prompts = load_prompts(cfg.prompts, tokenizer, cfg.max_samples)
        online = online_eval(target, drafter, prompts, max_new_tokens=cfg.max_new_tokens,
                             eos_ids=eos_token_ids(target, tokenizer))
        online.update(prompts=str(cfg.prompts), dtype=cfg.dtype, device=str(device))
        result["online"] = online
        result["lossless"] = online["lossless"]
        result["speedup"] = online["speedup"]
        if not online["lossless"]:
            lossless_failure = (
                f"speculative decoding differs from target-only greedy decoding on {len(online['mismatches'])} of "
                f"{len(prompts)} prompt(s) (first: {online['mismatches'][0]}); see 'mismatches' in the eval JSON."
            )
    result["tau"] = (result.get("offline") or result["online"])["tau"]

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


__all__ = ["offline_tau", "online_eval", "block_acceptance", "summarize", "load_prompts", "run_eval",
           "write_outputs"]
