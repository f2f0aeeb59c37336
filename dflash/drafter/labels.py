"""A packed row's labels as every family's loss and evaluation read them, and what a loss reports.

Blocks lie back to back from position 0 of each row, `block_size` positions each (padding at the end);
position k (1..B-1) of a block is labelled with the token at anchor + k, or IGNORE where there is none
(past the sample, not supervised, padding).  The acceptance length of a block is 1 + the number of leading
positions whose prediction equals the label (docs/DESIGN.md §3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100


@dataclass
class HeadPass:
    """One chunked pass of the frozen lm_head over the N labelled rows, before any weighting."""

    ce: torch.Tensor  # [N] fp32 cross-entropy of each row
    kd: torch.Tensor | None  # [N] fp32 T^2 KL(p_target || q) on the stored top-k (KD on), else None
    preds: torch.Tensor  # [N] int64 greedy predictions
    grad: torch.Tensor  # [N, H] d (ce + kd_weight * kd) / d hidden of each row, in hidden's dtype
    top_ids: torch.Tensor | None  # [N, K] int64: the K best candidates, best first (top_k > 0)
    top_logits: torch.Tensor | None  # [N, K] their logits, in the head's dtype (as the engines take them)


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar with grad: (sum w*ce + kd_weight * sum w*kd) / denom
    ce_sum: torch.Tensor  # sum over valid labels of w * ce (no grad, fp32)
    kd_sum: torch.Tensor  # sum over valid labels of w * kd (no grad, fp32; 0 when KD is off)
    weight_sum: torch.Tensor  # sum of w over valid labels
    correct: torch.Tensor  # [B] int64: correct greedy predictions per block position
    valid: torch.Tensor  # [B] int64: valid labels per block position
    tau_sum: torch.Tensor  # sum over blocks of acceptance length (1 + leading correct predictions)
    num_blocks: torch.Tensor  # blocks with a label at position 1 (every real block)
    tv_sum: torch.Tensor | None = None  # a family's distance to the target (DSpark: sum of w * sum|q - p|)
    conf_sum: torch.Tensor | None = None  # a family's confidence term (DSpark: sum of w * the head's BCE)
    row_weight: torch.Tensor | None = None  # [N] the weight of each labelled row (label_index order)
    head: HeadPass | None = None  # the lm_head pass (its top-K candidates feed a candidate selector)


def _blocks(preds: torch.Tensor, labels: torch.Tensor, block_size: int):
    """Blocks as rows: (acceptance length [n], right [n, B], valid [n, B], real [n]).

    preds, labels: [R, Q] with blocks laid out back to back from position 0 of each row (padding at
    the end, labels IGNORE).  A block's acceptance length is 1 + the number of leading positions
    k = 1.. whose prediction is right; an ignored label ends the run, as the sample ends there.  A block
    is real when position 1 has a label (anchors guarantee it; padding blocks have none).
    """
    R, Q = labels.shape
    nb = Q // block_size
    y = labels[:, : nb * block_size].reshape(R * nb, block_size)
    p = preds[:, : nb * block_size].reshape(R * nb, block_size)
    valid = y != IGNORE
    right = (p == y) & valid
    real = valid[:, 1] if block_size > 1 else valid.any(1)
    accepted = right[:, 1:].long().cumprod(dim=1).sum(dim=1) + 1
    return accepted, right, valid, real


def block_stats(preds: torch.Tensor, labels: torch.Tensor, block_size: int):
    """Per-position (correct, valid) counts, summed acceptance length and number of real blocks.

    Sync-free (no boolean indexing), for the training step."""
    accepted, right, valid, real = _blocks(preds, labels, block_size)
    return right.sum(0), valid.sum(0), (accepted * real).sum(), real.sum()


def block_acceptance(preds: torch.Tensor, labels: torch.Tensor, block_size: int):
    """Per real block: (acceptance length [n] in 1..B, right [n, B], valid [n, B]), for histograms."""
    accepted, right, valid, real = _blocks(preds, labels, block_size)
    return accepted[real], right[real], valid[real]


def labelled(labels: torch.Tensor, label_index: torch.Tensor | None) -> torch.Tensor:
    """The flat positions of `labels` that hold a label (`label_index` when the loader made it)."""
    flat = labels.reshape(-1)
    return label_index if label_index is not None else (flat != IGNORE).nonzero().squeeze(1)


def previous_tokens(labels: torch.Tensor, block_input_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """[R, Q]: the token before each block position's label (teacher forcing): the anchor token for block
    position 1, else the label one position earlier (IGNORE where there is none)."""
    Q = labels.shape[1]
    prev = torch.full_like(labels, IGNORE)
    k = torch.arange(1, Q, device=labels.device) % block_size  # block positions 1..Q-1
    # An anchor (k == 0) predicts nothing.  torch.where, not a boolean-mask assignment: on a GPU that
    # runs a nonzero(), a host sync in every training step.
    shifted = torch.where(k == 1, block_input_ids[:, :-1], labels[:, :-1])
    prev[:, 1:] = torch.where(k == 0, IGNORE, shifted)
    return prev


def greedy_predictions(hidden: torch.Tensor, lm_head: torch.Tensor, labels: torch.Tensor,
                       chunk: int = 4096) -> torch.Tensor:
    """[R, Q] argmax of the target lm_head, computed only where there is a label (-1 elsewhere), a chunk at
    a time."""
    flat = labels.reshape(-1)
    sel = (flat != IGNORE).nonzero().squeeze(1)
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, sel)
    preds = torch.full_like(flat, -1)
    out = torch.empty(len(sel), dtype=torch.long, device=hidden.device)
    for i in range(0, len(sel), chunk):
        out[i : i + chunk] = (h[i : i + chunk].to(lm_head.dtype) @ lm_head.t()).argmax(-1)
    preds[sel] = out
    return preds.view_as(labels)


__all__ = ["IGNORE", "HeadPass", "LossOutput", "block_acceptance", "block_stats", "greedy_predictions", "labelled",
           "previous_tokens"]
