"""Online eval: each held-out prompt decoded by the target alone and speculatively with the drafter
(dflash.evaluate.speculative), checked token for token, and summed up (docs/DESIGN.md §6).  One process
(`online_eval`) or several (dflash.evaluate.workers) run the same per-prompt code, `decode_prompts`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm import tqdm

from dflash.train.heldout import summarize

if TYPE_CHECKING:
    from dflash.evaluate.reference import ReferenceFile


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
    from transformers import DynamicCache

    from dflash.evaluate.speculative import _cache_kw, prefill

    ids = torch.cat([prompt, prompt.new_tensor(ref[:at])]).view(1, -1)
    out, _ = prefill(target, ids, {_cache_kw(target): DynamicCache(config=target.config), "use_cache": True})
    logits = out.logits[0, -1].float()
    return float(logits[ref[at]] - logits[got[at]])


@torch.no_grad()
def decode_prompts(target, drafter, prompts: list[list[int]], refs: list | None, *, max_new_tokens: int,
                   eos_ids: set[int], propose=None, confidence_threshold: float | None = None,
                   on_prompt=None) -> list[dict]:
    """Each prompt decoded target-only (unless `refs`, the target-only Generations, are given) and
    speculatively (and with the confidence head choosing the verified prefix, when the drafter has one
    and a threshold is set): one JSON-able record per prompt, in order.  `on_prompt()` after each."""
    from dflash.evaluate.speculative import greedy_generate, speculative_generate

    device = next(target.parameters()).device
    as_ids = [torch.tensor(p, dtype=torch.long, device=device) for p in prompts]
    # Warm-up (kernels, allocator, lazy inits) so that neither side pays it inside the timing.
    greedy_generate(target, as_ids[0], min(8, max_new_tokens), eos_ids)
    speculative_generate(target, drafter, as_ids[0], min(8, max_new_tokens), eos_ids, propose=propose)
    confident = confidence_threshold is not None and getattr(drafter, "confidence_head", None) is not None
    records = []
    for i, ids in enumerate(as_ids):
        ref = refs[i] if refs is not None and refs[i] is not None else greedy_generate(target, ids, max_new_tokens,
                                                                                         eos_ids)
        got = speculative_generate(target, drafter, ids, max_new_tokens, eos_ids, propose=propose)
        rec = {"prompt_tokens": len(prompts[i]), "ref": {"tokens": ref.tokens, "seconds": ref.seconds},
               "got": {"tokens": got.tokens, "seconds": got.seconds, "acceptance": got.acceptance}}
        if got.tokens != ref.tokens:
            at = next((j for j, (a, b) in enumerate(zip(got.tokens, ref.tokens)) if a != b),
                      min(len(got.tokens), len(ref.tokens)))
            rec["mismatch"] = {"prompt": i, "first_difference": at, "target_only": ref.tokens[at : at + 8],
                               "speculative": got.tokens[at : at + 8],
                               "logit_margin": _margin(target, ids, ref.tokens, got.tokens, at)}
        if confident:  # docs/DESIGN.md §12
            c = speculative_generate(target, drafter, ids, max_new_tokens, eos_ids,
                                     confidence_threshold=confidence_threshold)
            rec["confidence"] = {"tokens": c.tokens, "acceptance": c.acceptance, "verified": c.verified}
        records.append(rec)
        if on_prompt is not None:
            on_prompt()
    return records


def summarize_online(records: list[dict], block_size: int, threshold: float | None) -> dict:
    """tau, tokens/s both ways and losslessness over every prompt's record (decode_prompts)."""
    taus = [t for r in records for t in r["got"]["acceptance"]]
    # speeds from the prompts decoded one at a time (a batch's time is not one prompt's)
    timed = [r for r in records if r["ref"]["seconds"] is not None]
    spec_timed = [r for r in records if r["got"]["seconds"] is not None]
    base_s = sum(r["ref"]["seconds"] for r in timed)
    spec_s = sum(r["got"]["seconds"] for r in spec_timed)
    base_n = sum(len(r["ref"]["tokens"]) for r in timed)
    spec_n = sum(len(r["got"]["tokens"]) for r in records)
    spec_tps = sum(len(r["got"]["tokens"]) for r in spec_timed) / max(spec_s, 1e-9)
    mismatches = [r["mismatch"] for r in records if "mismatch" in r]
    out = summarize(np.asarray(taus), block_size)
    base_tps = base_n / max(base_s, 1e-9)
    if any("confidence" in r for r in records):
        ctaus = [t for r in records for t in r["confidence"]["acceptance"]]
        verified = [v for r in records for v in r["confidence"]["verified"]]
        conf = summarize(np.asarray(ctaus), block_size)
        conf.update(threshold=threshold,
                    lossless=all(r["confidence"]["tokens"] == r["ref"]["tokens"] for r in records),
                    drafts_verified_per_step=float(np.mean(verified)) if verified else 0.0,
                    tokens_per_target_forward=sum(len(r["confidence"]["tokens"]) for r in records)
                    / max(len(ctaus) + len(records), 1))
        out["confidence"] = conf
    out.update(
        # each prompt's own tau, to split the mean by prompt (length, turns) afterwards; the mean over
        # prompts weighted by their draft steps is `tau`
        per_prompt=[{"prompt_tokens": r.get("prompt_tokens"), "new_tokens": len(r["got"]["tokens"]),
                     "steps": len(r["got"]["acceptance"]),
                     "tau": float(np.mean(r["got"]["acceptance"])) if r["got"]["acceptance"] else None}
                    for r in records],
        lossless=not mismatches,
        mismatches=mismatches,
        num_prompts=len(records),
        new_tokens=spec_n,
        tokens_per_s_target=base_tps,
        tokens_per_s_speculative=spec_tps,
        speedup=spec_tps / base_tps if base_tps and spec_tps else None,
        tokens_per_target_forward=spec_n / max(len(taus) + len(records), 1),
    )
    return out


def reference_generations(records: list[dict]) -> list:
    from dflash.evaluate.speculative import Generation

    return [Generation(tokens=r["ref"]["tokens"], seconds=r["ref"]["seconds"]) for r in records]


@torch.no_grad()
def online_eval(target, drafter, prompts: list[list[int]], *, max_new_tokens: int, eos_ids: set[int],
                propose=None, progress: bool = True, confidence_threshold: float | None = None,
                reference: ReferenceFile | None = None) -> dict:
    """Speculative vs target-only greedy decoding on `prompts`: tau, tokens/s, token-for-token equality.

    With exact arithmetic the two outputs are identical; a mismatch means a bug (or, in bf16, a near-tie
    that one-token and block forwards round differently: `logit_margin` tells which).  `propose` is a
    test hook (see speculative_generate).  `confidence_threshold`: a drafter with a confidence head is also
    decoded with the head choosing the verified prefix, reported under "confidence" (docs/DESIGN.md §12).
    `reference` keeps the target-only outputs across evals (dflash.evaluate.reference)."""
    refs = reference.load() if reference is not None else None
    bar = tqdm(total=len(prompts), desc="speculative decoding", unit="prompt", disable=not progress)
    records = decode_prompts(target, drafter, prompts, refs, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                             propose=propose, confidence_threshold=confidence_threshold, on_prompt=bar.update)
    bar.close()
    return finish_online(records, drafter.config.block_size, confidence_threshold, reference, refs is not None)


def finish_online(records: list[dict], block_size: int, threshold: float | None, reference, reused: bool) -> dict:
    if reference is not None and not reused:
        reference.save(reference_generations(records))
    out = summarize_online(records, block_size, threshold)
    out["reference"] = None if reference is None else {"path": str(reference.path), "reused": reused}
    return out


__all__ = ["online_eval", "decode_prompts", "summarize_online", "finish_online", "eos_token_ids"]
