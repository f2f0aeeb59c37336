"""DFlash2's candidate selector: its K-way cross-entropy term and its proposals (docs/DESIGN.md §11).

Over the top-K lm_head candidates of each labelled position, the scores of `CandidateSelector` with the
teacher-forced predecessor (the anchor for block position 1, else the true token one position earlier),
target the label's index among the candidates; positions whose label is not among them (or whose
predecessor is unlabelled) weigh 0.  The backbone's hidden states and logits enter detached: the term
trains the selector only.

In training the candidates come from the loss's own lm_head pass (dflash.train.loss.block_loss with
`top_k`), so a step runs the head once.  Evaluation, which has no loss, gets them from `head_prepass`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from dflash.drafter.labels import IGNORE, block_stats, labelled, previous_tokens


@dataclass
class Prepass:
    ce: torch.Tensor | None  # [N] fp32: cross-entropy of each labelled position (label_index order), if asked
    unary: torch.Tensor | None  # [N, K] fp32: the selector's unary scores of the top-K, best first
    ids: torch.Tensor | None  # [N, K] int64


@torch.no_grad()
def head_prepass(hidden, lm_head, labels, sel, chunk: int = 2048, selector_of=None, ce: bool = True) -> Prepass:
    """Per-token CE (`ce`) and with `selector_of`, a DFlash2Drafter, its top-K candidates, of the labelled
    positions `sel` of hidden [R, Q, H], through the frozen lm_head a chunk at a time.  The top-K is taken on
    the logits in the head's dtype, as the engines take it (bf16 on GPU)."""
    h = hidden.detach().reshape(-1, hidden.shape[-1]).index_select(0, sel)
    y = labels.reshape(-1).index_select(0, sel)
    n = h.shape[0]
    out = torch.empty(n, dtype=torch.float32, device=h.device) if ce else None
    K = selector_of.config.selector_top_k if selector_of is not None else 0
    unary = torch.empty(n, K, dtype=torch.float32, device=h.device) if K else None
    ids = torch.empty(n, K, dtype=torch.long, device=h.device) if K else None
    with torch.autocast(device_type=h.device.type, enabled=False):
        for i in range(0, n, chunk):
            logits = h[i : i + chunk].to(lm_head.dtype) @ lm_head.t()
            if ce:
                x = logits.float()
                out[i : i + chunk] = torch.logsumexp(x, -1) - x.gather(1, y[i : i + chunk, None]).squeeze(1)
            if K:
                vals, ids[i : i + chunk] = torch.topk(logits, K, dim=-1)
                unary[i : i + chunk] = selector_of.unary(vals)
    return Prepass(out, unary, ids)


def selector_ce(selector, hidden_sel, pre: Prepass, y, prev, w):
    """(sum of w * K-way CE over learnable rows, predictions [N], learnable [N]) of the selector on the
    labelled rows: hidden_sel [N, H] (detached), labels y [N], predecessors prev [N], weights w [N]."""
    hits = pre.ids == y[:, None]
    learn = hits.any(-1) & (prev != IGNORE)
    with torch.autocast(device_type=hidden_sel.device.type, enabled=False):
        scores = selector.scores(hidden_sel.detach().float(), pre.unary, pre.ids, prev.clamp_min(0))
    ce = F.cross_entropy(scores, hits.int().argmax(-1), reduction="none")
    preds = pre.ids.gather(1, scores.detach().argmax(-1, keepdim=True)).squeeze(1)
    return (ce * w.float() * learn).sum(), preds, learn


def add_selector_term(out, drafter, hidden, labels, block_input_ids, sel, *, block_size: int, denom,
                      weight: float = 1.0):
    """`out` (block_loss's LossOutput, run with top_k = the selector's K) with the selector's term added to the
    loss (the rows weighted as in `out`, normalised by the same `denom`) and its acceptance statistics
    measured on the selector's proposals, as served."""
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, sel)
    y = labels.reshape(-1).index_select(0, sel)
    prev = previous_tokens(labels, block_input_ids, block_size).reshape(-1).index_select(0, sel)
    with torch.no_grad():
        pre = Prepass(None, drafter.unary(out.head.top_logits), out.head.top_ids)
    sel_sum, preds, _ = selector_ce(drafter.candidate_selector, h, pre, y, prev, out.row_weight)
    d = denom.to(sel_sum.dtype) if isinstance(denom, torch.Tensor) else denom
    full = torch.full((labels.numel(),), -1, dtype=torch.long, device=labels.device)
    full[sel] = preds
    correct, valid, tau_sum, num_blocks = block_stats(full.view_as(labels), labels, block_size)
    return replace(out, loss=out.loss + weight * sel_sum / d, correct=correct, valid=valid, tau_sum=tau_sum,
                   num_blocks=num_blocks)


@torch.no_grad()
def selector_predictions(drafter, hidden, lm_head, labels, block_input_ids, block_size: int,
                         chunk: int = 4096) -> torch.Tensor:
    """[R, Q] the DFlash2 drafter's proposals with teacher-forced predecessors (-1 where no label).  Up to
    the first miss they are the served greedy walk's, so the acceptance length they give is the served one."""
    sel = labelled(labels, None)
    pre = head_prepass(hidden, lm_head, labels, sel, chunk, selector_of=drafter, ce=False)
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, sel)
    prev = previous_tokens(labels, block_input_ids, block_size).reshape(-1).index_select(0, sel)
    y = labels.reshape(-1).index_select(0, sel)
    _, preds, _ = selector_ce(drafter.candidate_selector, h, pre, y, prev, torch.zeros_like(y, dtype=torch.float32))
    full = torch.full((labels.numel(),), -1, dtype=torch.long, device=labels.device)
    full[sel] = preds
    return full.view_as(labels)


__all__ = ["Prepass", "add_selector_term", "head_prepass", "selector_ce", "selector_predictions"]
