"""Greedy speculative decoding of many prompts at once: the steps of dflash.evaluate.speculative, one row
per prompt, every row drafting and verifying its own block in the same two forwards.

Rows accept different numbers of tokens, and transformers' cache cannot be cut back row by row; so every
verified block stays in the target's cache, and the attention mask hides, row by row, the positions of
the drafts that row rejected (and the left padding), while each row's RoPE positions follow its accepted
tokens only.  The drafter keeps no cache: each step it reads every row's accepted context again (its
features right-padded, the padding masked), which is what the one-prompt loop's cached context holds.
A row leaves the batch when it is done.  With exact arithmetic each row's tokens and acceptance are those
of decoding its prompt alone; the eval checks the tokens against the target-only reference either way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dflash.evaluate.speculative import Generation, LayerCapture, _cache_kw, _finish, prefill

# propose(row, start, proposals [B-1]) -> proposals [B-1]: a test hook that may replace a row's guesses.
RowProposeHook = Callable[[int, int, torch.Tensor], torch.Tensor]


def has_linear_attention(target) -> bool:
    types = getattr(target.config.get_text_config(), "layer_types", None) or []
    return "linear_attention" in types


def supports_batching(target, drafter, confidence: bool) -> bool:
    """Full-attention drafters proposing by argmax or their own head, against a target without
    linear-attention layers (whose states padded rows would mix): the others decode one prompt at a time."""
    return not (drafter.config.has_sliding or confidence or has_linear_attention(target))


class _Rows:
    """Per-row state of a batch: tokens, acceptance, anchor position, accepted context features."""

    def __init__(self, n: int, features: int, capacity: int, device, dtype):
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.acceptance: list[list[int]] = [[] for _ in range(n)]
        self.ctx = torch.zeros((n, capacity, features), device=device, dtype=dtype)
        self.ctx_len = torch.zeros(n, dtype=torch.long, device=device)  # = each row's anchor position

    def add_context(self, rows: torch.Tensor, feats: torch.Tensor, counts: list[int]) -> None:
        for r, f, n in zip(rows.tolist(), feats, counts):
            lo = int(self.ctx_len[r])
            self.ctx[r, lo : lo + n] = f[:n]
            self.ctx_len[r] = lo + n


def _draft(drafter, rows: _Rows, live: torch.Tensor, anchors: torch.Tensor, embed, head) -> torch.Tensor:
    """The live rows' proposals [n, B-1]: each block attends to its row's accepted context and to itself."""
    cfg = drafter.config
    B, device = cfg.block_size, anchors.device
    lens = rows.ctx_len[live]
    S = int(lens.max())
    ctx = rows.ctx[live, :S]
    ctx_pos = torch.arange(S, device=device).expand(len(live), S)
    block = torch.full((len(live), B), cfg.mask_token_id, dtype=torch.long, device=device)
    block[:, 0] = anchors
    block_pos = lens[:, None] + torch.arange(B, device=device)
    ctx_ok = ctx_pos < lens[:, None]
    mask = torch.cat([ctx_ok, ctx_ok.new_ones((len(live), B))], 1)[:, None, None, :].expand(-1, 1, B, -1)
    hidden = drafter(ctx, embed(block), ctx_pos, block_pos, mask)
    return drafter.propose(hidden[:, 1:].to(head.weight.dtype), head.weight, anchors)


@torch.inference_mode()
def speculative_rows(target, drafter, prompts: list[list[int]], max_new_tokens: int, eos_ids: set[int],
                     propose: RowProposeHook | None = None) -> list[Generation]:
    """Each prompt's greedy speculative decode, all in one batch (seconds None: not a one-prompt time)."""
    from transformers import DynamicCache

    cfg = drafter.config
    B = cfg.block_size
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    device = next(target.parameters()).device
    n, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros((n, width), dtype=torch.long, device=device)
    seen = torch.zeros((n, width), dtype=torch.long, device=device)  # 1 where a row attends: its tokens
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p, device=device)
        seen[r, width - len(p):] = 1
    capacity = width + max_new_tokens + B
    with LayerCapture(target, cfg.target_layer_ids) as capture:
        cache = DynamicCache(config=target.config)
        kw = {_cache_kw(target): cache, "use_cache": True}
        out, feats = prefill(target, ids, kw, mask=seen, positions=(seen.cumsum(-1) - 1).clamp(min=0),
                             capture=capture)
        rows = _Rows(n, feats.shape[-1], capacity, device, feats.dtype)
        for r, p in enumerate(prompts):
            rows.ctx[r, : len(p)] = feats[r, width - len(p):]
            rows.ctx_len[r] = len(p)
        anchors = out.logits[:, -1].argmax(-1)
        live = torch.arange(n, device=device)
        done = []
        for r in range(n):
            rows.tokens[r], d = _finish([int(anchors[r])], max_new_tokens, eos_ids)
            done.append(d)
        keep = [i for i in range(n) if not done[i]]
        while keep:
            if len(keep) < len(live):  # rows that finished leave the batch
                sel = torch.tensor(keep, device=device)
                cache.batch_select_indices(sel)
                live, anchors, seen = live[sel], anchors[sel], seen[sel]
            proposals = _draft(drafter, rows, live, anchors, embed, head)
            if propose is not None:
                proposals = torch.stack([propose(int(r), int(rows.ctx_len[r]), p).to(device=device, dtype=torch.long)
                                         for r, p in zip(live, proposals)])
            block = torch.cat([anchors[:, None], proposals], 1)
            start = rows.ctx_len[live]
            seen = torch.cat([seen, seen.new_ones((len(live), B))], 1)
            out = target(input_ids=block, attention_mask=seen, position_ids=start[:, None] + torch.arange(B, device=device),
                         **kw)
            posterior = out.logits.argmax(-1)  # [n, B]: the target's token after each block prefix
            acc = (block[:, 1:] == posterior[:, :-1]).long().cumprod(1).sum(1)
            seen[:, -B:] = (torch.arange(B, device=device) <= acc[:, None]).long()  # rejected drafts: hidden
            rows.add_context(live, capture.features(), (acc + 1).tolist())
            anchors = posterior.gather(1, acc[:, None])[:, 0]
            keep = []
            for i, (r, a) in enumerate(zip(live.tolist(), acc.tolist())):
                rows.acceptance[r].append(a + 1)
                new = block[i, 1 : a + 1].tolist() + [int(anchors[i])]
                rows.tokens[r], d = _finish(rows.tokens[r] + new, max_new_tokens, eos_ids)
                if not d:
                    keep.append(i)
    return [Generation(tokens=t, seconds=None, acceptance=a, verified=[B - 1] * len(a))
            for t, a in zip(rows.tokens, rows.acceptance)]


__all__ = ["has_linear_attention", "speculative_rows", "supports_batching"]
