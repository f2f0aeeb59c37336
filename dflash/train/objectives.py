"""Objectives beside the decayed cross-entropy of dflash.train.loss (docs/DESIGN.md §11).

- D-PACE (arXiv 2605.18810) per-position weights: from the drafter's own detached per-token cross-entropy
  of the micro-batch, w_k = sum_{j >= k} prod_{i <= j} s_i with s_i = (1 - alpha) * exp(-ce_i) + alpha over
  the block's labelled positions (an unlabelled position is neutral in the product and gets weight 0):
  the derivative of the expected accepted length sum_j prod_{i <= j} p_i with respect to log p_k, with
  p_i smoothed by alpha.  They are rescaled so that a micro-batch's D-PACE weights sum to its decay
  weights (the step's loss denominator stays the loader's, and the step stays free of host syncs).
- The DFlash2 selector's K-way cross-entropy: over the top-K lm_head candidates of each labelled
  position, the scores of dflash.drafter.dflash2.CandidateSelector with the teacher-forced predecessor (the
  anchor for block position 1, else the true token one position earlier), target the label's index among
  the candidates; positions whose label is not among them (or whose predecessor is unlabelled) weigh 0.
  The backbone's hidden states and logits enter detached: the term trains the selector only.

In training both come from the loss's own lm_head pass (dflash.train.loss.block_loss: `reweight` turns the
rows' cross-entropy into D-PACE weights, `top_k` keeps the candidates), so a step runs the head once.
Evaluation, which has no loss, gets the top-K from `head_prepass`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from dflash.train.loss import IGNORE, block_stats


def drafter_config_for(dcfg, cfg):
    """The drafter config a TrainConfig asks for (--arch and its knobs) from the DFlash one preflight
    derived from the target; a ConfigError for a choice that cannot train."""
    from dflash.drafter import VARIANTS, config_for
    from dflash.errors import ConfigError

    v = VARIANTS[cfg.drafter.arch]  # a name of the registry: TrainConfig checked its choices
    if (v.selects_candidates or v.dspark_heads) and cfg.systems.parallel == "fsdp":
        raise ConfigError(f"--arch {cfg.drafter.arch} trains its heads outside the drafter's forward, which FSDP2 does "
                          "not unshard; use --parallel ddp (the heads are small beside the layers).")
    try:
        return config_for(dcfg, cfg.drafter.arch, getattr(cfg, cfg.drafter.arch, None))  # its section's knobs
    except ValueError as e:
        raise ConfigError(f"--arch {cfg.drafter.arch} cannot be built on this target: {e}; change the {cfg.drafter.arch} option "
                          f"({', '.join('--' + k.replace('_', '-') for k in v.knobs)}).") from None


def dpace_weights(ce: torch.Tensor, valid: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """D-PACE weights [..., B] of per-token cross-entropies ce [..., B] (block positions last); valid [..., B]
    bool.  No gradient flows through them."""
    if not 0.0 <= float(alpha) <= 1.0:
        raise ValueError(f"dpace_alpha must lie in [0, 1], got {alpha}")
    with torch.no_grad():
        v = valid.to(torch.float32)
        s = (1.0 - alpha) * torch.exp(-ce.detach().float()) + alpha
        s = torch.where(valid, s, torch.ones_like(s))
        prefix = torch.cumprod(s, dim=-1) * v
        return prefix.flip(-1).cumsum(-1).flip(-1) * v


@dataclass
class Prepass:
    ce: torch.Tensor | None  # [N] fp32: cross-entropy of each labelled position (label_index order), if asked
    unary: torch.Tensor | None  # [N, K] fp32: the selector's unary scores of the top-K, best first
    ids: torch.Tensor | None  # [N, K] int64


def labelled(labels: torch.Tensor, label_index: torch.Tensor | None) -> torch.Tensor:
    flat = labels.reshape(-1)
    return label_index if label_index is not None else (flat != IGNORE).nonzero().squeeze(1)


@torch.no_grad()
def head_prepass(hidden, lm_head, labels, sel, chunk: int = 2048, selector_of=None, ce: bool = True) -> Prepass:
    """Per-token CE (`ce`, for D-PACE) and with `selector_of`, a DFlash2Drafter, its top-K candidates, of the
    labelled positions `sel` of hidden [R, Q, H], through the frozen lm_head a chunk at a time.  The top-K
    is taken on the logits in the head's dtype, as the engines take it (bf16 on GPU)."""
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


def dpace_loss_weight(ce_rows: torch.Tensor, labels, loss_weight, sel, block_size: int, alpha: float) -> torch.Tensor:
    """[R, Q] D-PACE weights in the layout of the loader's `loss_weight`, with the same sum, from the
    cross-entropy ce_rows [N] of the labelled positions `sel` (in that order)."""
    R, Q = labels.shape
    B, nb = block_size, Q // block_size
    ce = torch.zeros(R * Q, dtype=torch.float32, device=labels.device)
    ce[sel] = ce_rows.float()
    ce = ce.view(R, Q)[:, : nb * B].reshape(R * nb, B)
    valid = (labels[:, : nb * B] != IGNORE).reshape(R * nb, B)
    w = torch.zeros(R, Q, dtype=torch.float32, device=labels.device)
    w[:, : nb * B] = dpace_weights(ce, valid, alpha).view(R, nb * B)
    return w * (loss_weight.float().sum() / w.sum().clamp_min(1e-12))


def previous_tokens(labels: torch.Tensor, block_input_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """[R, Q]: the token before each block position's label (teacher forcing): the anchor token for block
    position 1, else the label one position earlier (IGNORE where there is none)."""
    Q = labels.shape[1]
    prev = torch.full_like(labels, IGNORE)
    k = torch.arange(1, Q, device=labels.device) % block_size  # block positions 1..Q-1
    prev[:, 1:] = torch.where(k == 1, block_input_ids[:, :-1], labels[:, :-1])
    prev[:, 1:][:, k == 0] = IGNORE  # an anchor predicts nothing
    return prev


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


__all__ = ["Prepass", "add_selector_term", "dpace_loss_weight", "drafter_config_for", "dpace_weights", "head_prepass",
           "labelled", "previous_tokens", "selector_ce", "selector_predictions"]
