"""Walk tau: the engine's speculative-decoding walk replayed on a store of the target's own greedy replies.

Greedy speculative decoding is lossless, so after a prompt it emits the target's own greedy reply.  On a
store whose replies the target wrote greedily (`dflash generate --temperature 0`, then `dflash
precompute`), the reply's tokens and its context features are what the engine sees, and its steps can be
replayed without the target in the loop (docs/DESIGN.md §6): the first anchor is the reply's first token
(the prefill's), a step drafts one block from the anchor and accepts the leading proposals equal to the
reply's next tokens, and the next anchor is the token after them (the target's bonus token).  A reply
stops after `max_new_tokens` tokens or once its last supervised token (the end of turn) is emitted, as
`dflash.evaluate.speculative` does; tau is the mean tokens per step over every step of every reply, as
`dflash eval --prompts` reports it.

Random anchors (`heldout.offline_tau`) weigh every position of a reply alike; the engine's walk crosses an
easy stretch in a few steps and a hard one in many, so its tau is lower than theirs (docs/RECIPE.md).  It
differs from the lossless eval's only through floating point: features computed over the whole reply
against the engine's incremental ones, and replies generated in another dtype than the eval's.

Each micro-batch's context is read once and its keys and values (`context_kv`, each layer's) stay on the
device; a step rebuilds only the blocks and runs the drafter on them against those.  Replies end after
different numbers of steps; once those still walking fit in fewer micro-batches, they are packed anew and
their contexts read again, so the drafter does not run a whole micro-batch for one slow reply.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from dflash.drafter import attention
from dflash.drafter.labels import _blocks
from dflash.errors import StoreError
from dflash.train import loader as L
from dflash.train.heldout import check_store, predictions, summarize


def reply_span(loss_mask: np.ndarray) -> tuple[int, int] | None:
    """(first, last) position of the sample's last supervised run, the reply the walk follows; None when
    that run is shorter than two tokens (no block to draft)."""
    m = np.asarray(loss_mask, dtype=bool)
    sup = np.flatnonzero(m)
    if len(sup) == 0:
        return None
    last = int(sup[-1])
    gaps = np.flatnonzero(~m[: last + 1])
    first = int(gaps[-1]) + 1 if len(gaps) else 0
    return (first, last) if last > first and first > 0 else None


class _Blocks(L.PackedDataset):
    """Each sample's one block at its walk anchor `at[idx]`, with no context features (the walk keeps those
    on the device): a step's batch costs only its block stream and mask metadata."""

    def __init__(self, store, spec: L.LoaderSpec, tokens: dict[int, tuple[np.ndarray, np.ndarray]]):
        super().__init__(store, spec)
        self.tokens = tokens
        self.max_blocks = np.where([i in tokens for i in range(len(self.sample_ids))], 1, 0)
        self.at = np.zeros(len(self.sample_ids), dtype=np.int64)

    def _sample(self, idx: int, epoch: int) -> dict:
        ids, lm = self.tokens[idx]
        anchors = self.at[idx : idx + 1].copy()
        blocks = L.block_targets(ids, lm, anchors, self.spec.block_size, self.spec.mask_token_id, self.weights)
        return dict(sid=int(self.sample_ids[idx]), T=len(ids), hidden=torch.empty(len(ids), 0, dtype=torch.bfloat16),
                    anchors=anchors, **blocks)

    def _direct(self) -> bool:
        return False


def _replies(store, sids, row: int) -> tuple[dict, dict, int]:
    """({idx: (input_ids, loss_mask)}, {idx: reply_span}, how many were longer than `row`) of the samples
    `sids` (idx: the position in sids) with a reply to walk; a longer sample is left out whole, since cut
    to the row it would lose the reply and walk an earlier turn instead."""
    tokens, span, too_long = {}, {}, 0
    for idx, sid in enumerate(sids):
        d = store.read(int(sid), fields=("input_ids", "loss_mask"))
        if len(d["input_ids"]) > row:
            too_long += 1
            continue
        ids, lm = d["input_ids"].numpy(), d["loss_mask"].numpy().astype(bool)
        s = reply_span(lm)
        if s is not None:
            tokens[idx], span[idx] = (ids, lm), s
    if not tokens:
        raise StoreError(f"walk tau: no sample of store {store.path} has a reply to walk within {row:,} tokens "
                         f"({too_long} longer, left out whole); give a larger --token-budget or a store of "
                         "shorter conversations.")
    return tokens, span, too_long


@torch.no_grad()
def walk_tau(drafter, embed: torch.Tensor, lm_head: torch.Tensor, store, *, max_new_tokens: int = 128,
             max_samples: int | None = None, token_budget: int | None = None, rows_per_batch: int = 4,
             block_budget: int | None = None, num_shapes: int = 3, progress: bool = True,
             repack: bool = True) -> dict:
    """The engine's greedy walk over each sample's last reply (module docstring).

    `block_budget`: block tokens a row (default one tile).
    `num_shapes`: padded context shapes (LoaderSpec); a compiled drafter compiles each one it meets.
    `repack`: once the replies still walking fit in fewer micro-batches than those they are in, they are
    packed anew (their contexts read again), so a micro-batch is not run for its last slow reply alone.
    Returns summarize()'s {tau, num_blocks (the steps), block_size, acceptance, tau_hist}, num_samples,
    num_too_long: samples longer than a row, left out whole (cut, they would lose the reply walked), and
    num_calls: the drafter's forward passes.
    """
    cfg = drafter.config
    B = cfg.block_size
    check_store(store, cfg)
    device = next(drafter.parameters()).device
    longest = int(store.lengths().max())
    budget = token_budget or L.round_up(longest)
    # One block a sample: a row's block stream is one tile (up to 128 / B samples a row), not padded to the
    # context's length, or every step would run the drafter on ~1,000 padded block tokens a row.
    spec = L.LoaderSpec(block_size=B, num_anchors=1, token_budget=budget, block_budget=block_budget or L.round_up(B),
                        rows_per_batch=rows_per_batch, mask_token_id=cfg.mask_token_id, seed=0, num_shapes=num_shapes,
                        sliding_window=cfg.sliding_window if cfg.has_sliding else None)
    sids = store.sample_ids()[:max_samples] if max_samples is not None else store.sample_ids()
    tokens, span, too_long = _replies(store, sids, spec.s_shapes[-1])
    blocks = _Blocks(store, spec, tokens)
    feats = L.PackedDataset(store, spec)
    feats.max_blocks = blocks.max_blocks
    first = np.array([span.get(i, (0, 0))[0] for i in range(len(blocks.sample_ids))], dtype=np.int64)
    last = np.array([span.get(i, (0, 0))[1] for i in range(len(blocks.sample_ids))], dtype=np.int64)
    blocks.at[:] = first
    emitted = np.ones(len(first), dtype=np.int64)  # the prefill's token
    active = blocks.max_blocks.astype(bool)
    embed, lm_head = embed.to(device), lm_head.to(device)
    steps: list[int] = []
    was_training = drafter.training
    drafter.eval()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    bar = tqdm(total=int(active.sum()), desc="walk tau", unit="reply", disable=not progress, leave=False)
    calls = 0

    def pack(walking: np.ndarray) -> list:
        """The micro-batches of the samples still walking: the training plan's packing, over them alone."""
        return L.plan_epoch(blocks.lengths, walking.astype(np.int64), spec, 0).batches

    def contexts(plan: list) -> list:
        """Each micro-batch's context keys and values, on the device."""
        ctx = []
        for rows in plan:
            mb = feats.build(0, rows).to(device).dequantised()
            with autocast:
                ctx.append(drafter.context_kv(mb.ctx_hidden, mb.ctx_positions))
        return ctx

    try:
        plan = pack(active)
        ctx = contexts(plan)
        walking = int(active.sum())  # at the last packing check: an unchanged set packs as it did then
        while active.any():
            for rows, ctx_kv in zip(plan, ctx):
                if not any(active[r].any() for r in rows):
                    continue
                calls += 1
                b = blocks.build(0, rows).to(device)
                mask = attention.mask_for(b.mask, device, compiled=attention.is_compiled(drafter))
                with autocast:
                    hidden = drafter(None, F.embedding(b.block_input_ids, embed), None, b.block_positions, mask,
                                     ctx_kv=ctx_kv)
                preds = predictions(drafter, hidden, lm_head, b.labels, b.block_input_ids, B)
                accepted = _blocks(preds, b.labels, B)[0].view(b.labels.shape[0], -1).cpu().numpy()
                for r, row in enumerate(rows):
                    for j, i in enumerate(row):
                        if not active[i]:
                            continue
                        n = int(accepted[r, j])
                        steps.append(n)
                        emitted[i] += n
                        blocks.at[i] += n
                        if emitted[i] >= max_new_tokens or blocks.at[i] >= last[i]:
                            active[i] = False  # reply done: the walk is back at first[i] to keep its block real
                            blocks.at[i] = first[i]
                            bar.update(1)
            bar.set_postfix(tau=f"{np.mean(steps):.3f}" if steps else "-")
            live = sum(any(active[r].any() for r in rows) for rows in plan)
            fewer = pack(active) if repack and live > 1 and active.sum() < walking else plan
            walking = int(active.sum())
            if len(fewer) < live:
                ctx = None  # the old contexts' keys and values go before the new ones are made
                plan, ctx = fewer, contexts(fewer)
    finally:
        drafter.train(was_training)
        bar.close()
    out = summarize(np.asarray(steps, dtype=np.int64), B)
    out["num_samples"] = len(tokens)
    out["num_too_long"] = too_long
    out["max_new_tokens"] = max_new_tokens
    out["num_calls"] = calls
    return out


__all__ = ["reply_span", "walk_tau"]
