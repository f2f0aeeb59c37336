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


class _Progress:
    """Each reply's walk: its anchor (the blocks' `at`), the tokens it has emitted, whether it still walks,
    and the accepted tokens of every step taken."""

    def __init__(self, blocks: _Blocks, span: dict, max_new_tokens: int):
        n = len(blocks.sample_ids)
        self.blocks, self.max_new_tokens = blocks, max_new_tokens
        self.first = np.array([span.get(i, (0, 0))[0] for i in range(n)], dtype=np.int64)
        self.last = np.array([span.get(i, (0, 0))[1] for i in range(n)], dtype=np.int64)
        blocks.at[:] = self.first
        self.emitted = np.ones(n, dtype=np.int64)  # the prefill's token
        self.active = blocks.max_blocks.astype(bool)
        self.steps: list[int] = []

    def any_walking(self, rows) -> bool:
        return any(self.active[r].any() for r in rows)

    def advance(self, rows, accepted: np.ndarray) -> int:
        """One step of each walking reply in `rows` (accepted[r, j]: sample rows[r][j]'s accepted proposals);
        returns how many replies ended."""
        ended = 0
        for r, row in enumerate(rows):
            for j, i in enumerate(row):
                if not self.active[i]:
                    continue
                n = int(accepted[r, j])
                self.steps.append(n)
                self.emitted[i] += n
                self.blocks.at[i] += n
                if self.emitted[i] >= self.max_new_tokens or self.blocks.at[i] >= self.last[i]:
                    self.active[i] = False  # reply done: the walk is back at first[i] to keep its block real
                    self.blocks.at[i] = self.first[i]
                    ended += 1
        return ended


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
    budget = token_budget or L.round_up(int(store.lengths().max()))
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
    walk = _Progress(blocks, span, max_new_tokens)
    embed, lm_head = embed.to(device), lm_head.to(device)
    was_training = drafter.training
    drafter.eval()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    bar = tqdm(total=int(walk.active.sum()), desc="walk tau", unit="reply", disable=not progress, leave=False)
    calls = 0

    def pack(active: np.ndarray) -> list:
        """The micro-batches of the samples still walking: the training plan's packing, over them alone."""
        return L.plan_epoch(blocks.lengths, active.astype(np.int64), spec, 0).batches

    def contexts(plan: list) -> list:
        """Each micro-batch's context keys and values, on the device."""
        ctx = []
        for rows in plan:
            mb = feats.build(0, rows).to(device).dequantised()
            with autocast:
                ctx.append(drafter.context_kv(mb.ctx_hidden, mb.ctx_positions))
        return ctx

    try:
        plan = pack(walk.active)
        ctx = contexts(plan)
        checked = int(walk.active.sum())  # at the last packing check: an unchanged set packs as it did then
        while walk.active.any():
            for rows, ctx_kv in zip(plan, ctx):
                if not walk.any_walking(rows):
                    continue
                calls += 1
                b = blocks.build(0, rows).to(device)
                mask = attention.mask_for(b.mask, device, compiled=attention.is_compiled(drafter))
                with autocast:
                    hidden = drafter(None, F.embedding(b.block_input_ids, embed), None, b.block_positions, mask,
                                     ctx_kv=ctx_kv)
                preds = predictions(drafter, hidden, lm_head, b.labels, b.block_input_ids, B)
                accepted = _blocks(preds, b.labels, B)[0].view(b.labels.shape[0], -1).cpu().numpy()
                bar.update(walk.advance(rows, accepted))
            bar.set_postfix(tau=f"{np.mean(walk.steps):.3f}" if walk.steps else "-")
            live = sum(walk.any_walking(rows) for rows in plan)
            fewer = pack(walk.active) if repack and live > 1 and walk.active.sum() < checked else plan
            checked = int(walk.active.sum())
            if len(fewer) < live:
                ctx = None  # the old contexts' keys and values go before the new ones are made
                plan, ctx = fewer, contexts(fewer)
    finally:
        drafter.train(was_training)
        bar.close()
    out = summarize(np.asarray(walk.steps, dtype=np.int64), B)
    out.update(num_samples=len(tokens), num_too_long=too_long, max_new_tokens=max_new_tokens, num_calls=calls)
    return out


__all__ = ["reply_span", "walk_tau"]
