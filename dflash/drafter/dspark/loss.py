"""DSpark's objective (docs/DESIGN.md §12): cross-entropy, the L1 distance to the target's distribution and
the confidence head's BCE, over the labelled block positions, chunked over positions.

Per labelled position with drafter logits z = lm_head(h) + markov_w2(markov_w1[prev]) (prev the true
previous token: teacher forcing), q = softmax(z) and the target's next-token distribution p:

    ce   = -log q[label]
    l1   = sum_v |q_v - p_v|                      (= 2 TV; DeepSpec's `l1_dist_per_token`)
    a    = clamp(1 - l1 / 2, 0, 1)                (sum_v min(p_v, q_v): the probability the target accepts)
    bce  = BCE(sigmoid(confidence(h, prev)), a)   (a detached: the target the head learns)
    loss = (ce_weight * sum w ce + tv_weight * sum w l1 + confidence_weight * sum w bce) / denom

`p` is either the full distribution, softmax(lm_head(final_norm(final_hidden))) of the target position
that predicted the label, recomputed here without gradient from the store's final hidden state with the
target's own frozen norm and head; or the stored top-k renormalised (`tv_source: topk`), where the drafter's
mass outside the k ids counts in full: l1 = sum_k |q_k - p_k| + (1 - sum_k q_k).

Each chunk of positions runs under activation checkpointing: its [c, V] logits (drafter and target) exist
only while the chunk is computed, and again in the backward pass, which recomputes them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflash.drafter.labels import IGNORE, LossOutput, block_stats

TV_SOURCES = ("final_hidden", "topk")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The target's final norm as transformers' Qwen3/Llama RMSNorm computes it (fp32 statistics, the weight
    applied in the input's dtype)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


@torch.no_grad()
def target_logprobs(final_hidden: torch.Tensor, norm_weight: torch.Tensor, lm_head: torch.Tensor,
                    eps: float) -> torch.Tensor:
    """[c, V] fp32 log-probabilities of the target's next token from its pre-norm last hidden states [c, H]."""
    h = rms_norm(final_hidden.to(norm_weight.dtype), norm_weight, eps)
    return torch.log_softmax((h.to(lm_head.dtype) @ lm_head.t()).float(), -1)


def l1_distance(logq: torch.Tensor, target) -> torch.Tensor:
    """sum_v |q_v - p_v| per row; `target` is ("full", logp [c, V]) or ("topk", ids [c, K], p [c, K])."""
    q = logq.exp()
    if target[0] == "full":
        return (q - target[1].exp()).abs().sum(-1)
    _, ids, p = target
    qk = q.gather(1, ids)
    return (qk - p).abs().sum(-1) + (1.0 - qk.sum(-1)).clamp_min(0.0)


def _chunk_sums(h, prev, y, w, tgt_a, tgt_b, drafter, lm_head, kind: str, norm_weight, eps: float):
    """(sum w ce, sum w l1, sum w bce, greedy predictions) of one chunk of positions."""
    logq = torch.log_softmax(drafter.head_logits(h, lm_head, prev).float(), -1)
    ce = -logq.gather(1, y[:, None]).squeeze(1)
    if kind == "final_hidden":
        target = ("full", target_logprobs(tgt_a, norm_weight, lm_head, eps))
    else:
        target = ("topk", tgt_a, tgt_b)
    l1 = l1_distance(logq, target)
    accept = (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)
    conf = drafter.confidence(h, prev)
    bce = (F.binary_cross_entropy_with_logits(conf, accept, reduction="none") if conf is not None
           else torch.zeros_like(ce))
    return (w * ce).sum(), (w * l1).sum(), (w * bce).sum(), logq.detach().argmax(-1)


def dspark_block_loss(drafter, hidden, lm_head, labels, loss_weight, prev, *, block_size: int, denom,
                      ce_weight: float, tv_weight: float, confidence_weight: float, tv_source: str,
                      final_hidden=None, norm_weight=None, eps: float = 1e-6, topk_ids=None, topk_logprobs=None,
                      chunk: int = 2048, label_index=None) -> LossOutput:
    """The DSpark loss and metrics of one micro-batch.

    hidden [R, Q, H] (after the drafter's norm), labels / loss_weight / prev [R, Q] (prev: the token before
    each label, objectives.previous_tokens), final_hidden [R, Q, H] (the target's pre-norm state at each
    label's source position) with the target's final-norm weight, or topk_* [R, Q, K].  A labelled position
    whose predecessor is unknown (IGNORE: the previous position is unsupervised) weighs 0, as DeepSpec stops a
    block's supervision at its first unsupervised position."""
    if tv_source not in TV_SOURCES:
        raise ValueError(f"tv_source must be one of {', '.join(TV_SOURCES)}, got {tv_source!r}")
    R, Q, H = hidden.shape
    flat = labels.reshape(-1)
    sel = label_index if label_index is not None else (flat != IGNORE).nonzero().squeeze(1)
    # The head runs in its own dtype (bf16 on GPU), as block_loss runs it: no fp32 copy of [V, H] per chunk.
    h = hidden.reshape(-1, H).index_select(0, sel).to(lm_head.dtype)
    y = flat.index_select(0, sel)
    p_ = prev.reshape(-1).index_select(0, sel)
    w = loss_weight.reshape(-1).index_select(0, sel).float() * (p_ != IGNORE)
    p_ = p_.clamp_min(0)
    if tv_source == "final_hidden":
        if final_hidden is None or norm_weight is None:
            raise ValueError("tv_source final_hidden needs final_hidden and the target's final norm weight")
        ta, tb = final_hidden.reshape(-1, final_hidden.shape[-1]).index_select(0, sel), None
    else:
        if topk_ids is None:
            raise ValueError("tv_source topk needs topk_ids and topk_logprobs")
        ta = topk_ids.reshape(-1, topk_ids.shape[-1]).index_select(0, sel)
        tb = torch.softmax(topk_logprobs.reshape(-1, topk_logprobs.shape[-1]).index_select(0, sel).float(), -1)
    sums = [hidden.new_zeros((), dtype=torch.float32) for _ in range(3)]
    preds = torch.empty(h.shape[0], dtype=torch.long, device=h.device)
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        for i in range(0, h.shape[0], chunk):
            s = slice(i, i + chunk)
            args = (h[s], p_[s], y[s], w[s], ta[s], None if tb is None else tb[s], drafter, lm_head, tv_source,
                    norm_weight, float(eps))
            if torch.is_grad_enabled():
                *parts, preds[s] = checkpoint(_chunk_sums, *args, use_reentrant=False)
            else:
                *parts, preds[s] = _chunk_sums(*args)
            sums = [a + b for a, b in zip(sums, parts)]
    ce_sum, tv_sum, conf_sum = sums
    total = ce_weight * ce_sum + tv_weight * tv_sum + confidence_weight * conf_sum
    full = torch.full((R * Q,), -1, dtype=torch.long, device=hidden.device)
    full[sel] = preds
    correct, valid, tau_sum, num_blocks = block_stats(full.view(R, Q), labels, block_size)
    d = denom.to(total.dtype) if isinstance(denom, torch.Tensor) else denom
    return LossOutput(loss=total / d, ce_sum=ce_sum.detach(), kd_sum=ce_sum.new_zeros(()), weight_sum=w.sum(),
                      correct=correct, valid=valid, tau_sum=tau_sum, num_blocks=num_blocks,
                      tv_sum=tv_sum.detach(), conf_sum=conf_sum.detach())


@torch.no_grad()
def dspark_predictions(drafter, hidden, lm_head, labels, prev, chunk: int = 4096) -> torch.Tensor:
    """[R, Q] greedy proposals with the Markov bias of the true previous token (-1 where no label): up to
    the first miss they are the served walk's, so the acceptance length they give is the served one."""
    flat = labels.reshape(-1)
    sel = (flat != IGNORE).nonzero().squeeze(1)
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, sel).to(lm_head.dtype)
    p_ = prev.reshape(-1).index_select(0, sel).clamp_min(0)
    out = torch.full_like(flat, -1)
    preds = torch.cat([drafter.head_logits(h[i:i + chunk], lm_head, p_[i:i + chunk]).argmax(-1)
                       for i in range(0, h.shape[0], chunk)]) if h.shape[0] else sel
    out[sel] = preds
    return out.view_as(labels)


__all__ = ["TV_SOURCES", "dspark_block_loss", "dspark_predictions", "l1_distance", "rms_norm", "target_logprobs"]
