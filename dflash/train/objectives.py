"""Objectives beside the decayed cross-entropy of dflash.train.loss.

D-PACE (arXiv 2605.18810) per-position weights: from the drafter's own detached per-token cross-entropy
of the micro-batch, w_k = sum_{j >= k} prod_{i <= j} s_i with s_i = (1 - alpha) * exp(-ce_i) + alpha over
the block's labelled positions (an unlabelled position is neutral in the product and gets weight 0):
the derivative of the expected accepted length sum_j prod_{i <= j} p_i with respect to log p_k, with
p_i smoothed by alpha.  They are rescaled so that a micro-batch's D-PACE weights sum to its decay
weights (the step's loss denominator stays the loader's, and the step stays free of host syncs).

In training they come from the loss's own lm_head pass (dflash.train.loss.block_loss: `reweight` turns the
rows' cross-entropy into D-PACE weights), so a step runs the head once.  A drafter family's own terms live
in its package (dflash.drafter.<family>).
"""

from __future__ import annotations

import torch

from dflash.drafter.labels import IGNORE


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


__all__ = ["dpace_loss_weight", "dpace_weights"]
