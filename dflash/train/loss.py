"""The drafter's loss: frozen lm_head + decayed cross-entropy (+ optional KD), chunked over positions.

A block stream of 4096 queries against a 152k vocabulary is 2.5 GB of fp32 logits, twice over for the
softmax.  `head_pass` never holds more than `chunk` rows of logits: chunk by chunk, it computes each
labelled row's cross-entropy (and KD term), its greedy prediction, the top-K candidates a candidate
selector needs, and the gradient of the row's terms with respect to the drafter's output (the lm_head is
frozen, so that is the only gradient needed), and keeps only the last, `[N, H]`, for backward.  The loss is a
weighted sum of per-row terms, so the weights can be chosen after the pass (D-PACE's come from the rows'
own cross-entropy) and backward scales each stored row gradient by its weight and the incoming scalar:
one lm_head pass a step whatever the objective.

Semantics (docs/DESIGN.md §3): block position k (1..B-1) predicts the token at anchor + k with weight
exp(-(k-1)/gamma); the loss is the weighted mean over valid labels, normalised by a denominator the
caller passes in (the global sum of weights of the optimizer step, so that several micro-batches and
several processes give exactly the gradient of one big batch).  The KD term compares the drafter with
the stored top-k target distribution (renormalised over its k entries) as KL(p_target || q_drafter) on
that support, scaled by T^2 as usual for distillation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dflash.drafter.labels import IGNORE, HeadPass, LossOutput, block_acceptance, block_stats

_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """DFlash's decay constants; other block sizes get B/2 - 1 (which also gives 7 for B=16)."""
    return _GAMMA.get(block_size, max(1.0, block_size / 2 - 1))


def position_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """[B] float32: 0 for the anchor position (its token is given), exp(-(k-1)/gamma) for k >= 1."""
    g = default_gamma(block_size) if gamma is None else float(gamma)
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / g)
    w[0] = 0.0
    return w


def chunk_terms(logits, labels, weights, topk_ids, topk_p, kd_weight: float, temperature: float):
    """One chunk of positions: (ce [c], kd [c] (zeros when KD is off), greedy predictions, d loss / d logits
    in the logits' dtype, each row's scaled by its weight).  Written as plain tensor code so that
    torch.compile can fuse it into a couple of passes over the [c, V] logits (eager, it makes ~10 fp32
    passes: the biggest non-matmul cost of a step at a 152k vocabulary).  topk_p is the target's
    renormalised top-k distribution, or None."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    preds = x.argmax(dim=-1)
    w = weights[:, None]
    ce = lse.squeeze(1) - x.gather(1, labels[:, None]).squeeze(1)
    onehot = torch.arange(x.shape[1], device=x.device)[None, :] == labels[:, None]
    g = (torch.exp(x - lse) - onehot.float()) * w  # d ce / d logits = softmax - onehot
    kd = torch.zeros_like(ce)
    if topk_p is not None:
        T = temperature
        lse_t = torch.logsumexp(x / T, dim=-1, keepdim=True)
        logq = x.gather(1, topk_ids) / T - lse_t
        kd = (topk_p * (torch.log(topk_p.clamp_min(1e-30)) - logq)).sum(-1) * (T * T)
        # d (T^2 KL) / d logits = T * (softmax(logits / T) - p scattered onto the vocabulary)
        scale = w * (kd_weight * T)
        g = (g + torch.exp(x / T - lse_t) * scale).scatter_add(1, topk_ids, -topk_p * scale)
    return ce, kd, preds, g.to(logits.dtype)


def chunk_terms_eager(logits, labels, weights, topk_ids, topk_p, kd_weight: float, temperature: float):
    """chunk_terms for eager mode (--compile off, CPU): the same values, computed with in-place passes
    over one fp32 [c, V] buffer, which eager PyTorch runs faster than chunk_terms' fusible form."""
    x = logits.float()
    preds = x.argmax(dim=-1)
    logp = torch.log_softmax(x, dim=-1)
    ce = -logp.gather(1, labels[:, None]).squeeze(1)
    g = logp.exp_()  # softmax; d ce / d logits = softmax - onehot
    g[torch.arange(g.shape[0], device=g.device), labels] -= 1.0
    g *= weights[:, None]
    kd = torch.zeros_like(ce)
    if topk_p is not None:
        T = temperature
        logq = torch.log_softmax(x / T, dim=-1)
        kd = (topk_p * (torch.log(topk_p.clamp_min(1e-30)) - logq.gather(1, topk_ids))).sum(-1) * (T * T)
        gk = logq.exp_()
        gk.scatter_add_(1, topk_ids, -topk_p)
        g += gk * (kd_weight * T) * weights[:, None]
    return ce, kd, preds, g.to(logits.dtype)


# How a chunk's softmax, argmax and gradient are computed: the same values three ways.
#   eager     chunk_terms_eager: in-place passes over one fp32 buffer (--compile off, CPU)
#   compiled  chunk_terms through torch.compile: a couple of fused passes (a compiled drafter)
#   triton    dflash.train.loss_kernel's kernel, the gradient written over the logits (CUDA, KD off)
# `chunk_kernel` picks one for a run; block_loss computes with the one it is given.
KERNELS = ("eager", "compiled", "triton")
_COMPILED = {}


def _terms_fn(kernel: str):
    """The per-chunk function of `kernel`.  chunk_terms is compiled once per process (always from the
    training thread: the loss runs in the step, never in a worker or side thread); the chunk's row count
    is marked dynamic by the caller, so the short last chunk of every step does not recompile."""
    if kernel == "triton":
        return _triton_terms
    if kernel == "eager":
        return chunk_terms_eager
    if "fn" not in _COMPILED:
        _COMPILED["fn"] = torch.compile(chunk_terms, dynamic=False)
    return _COMPILED["fn"]


def _triton_terms(logits, labels, weights, topk_ids, topk_p, kd_weight: float, temperature: float):
    """chunk_terms (KD off) by dflash.train.loss_kernel's one-pass-and-a-half kernel; g overwrites the logits."""
    from dflash.train.loss_kernel import fused_ce_terms

    ce, preds, g = fused_ce_terms(logits, labels, weights)
    return ce, torch.zeros_like(ce), preds, g


def triton_runs(use_kd: bool, device: torch.device) -> bool:
    """Whether the Triton kernel can compute a chunk's terms: KD off, triton importable, and a CUDA device
    (or TRITON_INTERPRET=1, which runs it on the CPU for the tests)."""
    if use_kd:
        return False
    from dflash.train import loss_kernel

    return loss_kernel.available() and (device.type == "cuda" or loss_kernel.interpret_mode())


def chunk_kernel(asked: str, use_kd: bool, device: torch.device, compiled: bool) -> str:
    """The kernel (KERNELS) a run's --loss-kernel `asked` ("triton" or "compiled") gets: the Triton one
    where it runs, else torch's, compiled when the drafter is."""
    if asked not in ("compiled", "triton"):
        raise ValueError(f"--loss-kernel must be 'compiled' or 'triton', got {asked!r}")
    if asked == "triton" and triton_runs(use_kd, device):
        return "triton"
    return "compiled" if compiled else "eager"


def loss_kernel_note(kernel: str, use_kd: bool, device: torch.device) -> str:
    """Which per-chunk kernel a run gets, and why not the Triton one when it asked for it (for the banner:
    the fallback is otherwise silent)."""
    if kernel not in ("compiled", "triton"):
        raise ValueError(f"kernel must be 'compiled' or 'triton', got {kernel!r}")
    if kernel == "triton" and triton_runs(use_kd, device):
        return "triton"
    if kernel != "triton":
        return "torch"
    from dflash.train import loss_kernel

    why = "KD is on" if use_kd else "triton is not installed" if not loss_kernel.available() else "no CUDA device"
    return f"torch (--loss-kernel triton falls back: {why})"


@torch.no_grad()
def head_pass(h, head, y, *, topk_ids=None, topk_p=None, kd_weight: float = 0.0, temperature: float = 1.0,
              chunk: int = 2048, kernel: str = "eager", top_k: int = 0) -> HeadPass:
    """The lm_head over labelled rows h [N, H] with labels y [N], `chunk` rows at a time (see HeadPass).
    KD is on when kd_weight > 0 and topk_p (the target's renormalised top-k distribution) is given; top_k > 0
    also keeps the K best candidates, taken before a kernel overwrites the logits with their gradient."""
    n = h.shape[0]
    grad = torch.empty_like(h)
    ce = torch.empty(n, dtype=torch.float32, device=h.device)
    kd = torch.empty(n, dtype=torch.float32, device=h.device) if topk_p is not None else None
    preds = torch.empty(n, dtype=torch.long, device=h.device)
    top_ids = torch.empty(n, top_k, dtype=torch.long, device=h.device) if top_k else None
    top_logits = torch.empty(n, top_k, dtype=head.dtype, device=h.device) if top_k else None
    ones = torch.ones(min(n, chunk), dtype=torch.float32, device=h.device)  # rows are weighted after the pass
    terms = _terms_fn(kernel)
    for i in range(0, n, chunk):
        j = min(n, i + chunk)
        logits = h[i:j].to(head.dtype) @ head.t()  # [c, V]; the only full-vocabulary tensor alive
        if top_k:
            top_logits[i:j], top_ids[i:j] = torch.topk(logits, top_k, dim=-1)
        y_c, w_c = y[i:j], ones[: j - i]
        ids = p = None
        if kd is not None:
            ids, p = topk_ids[i:j], topk_p[i:j]
        if kernel == "compiled":
            for t in (logits, y_c, w_c) + ((ids, p) if kd is not None else ()):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        ce[i:j], kd_c, preds[i:j], g = terms(logits, y_c, w_c, ids, p, float(kd_weight), float(temperature))
        if kd is not None:
            kd[i:j] = kd_c
        grad[i:j] = (g @ head).to(h.dtype)
    return HeadPass(ce, kd, preds, grad, top_ids, top_logits)


class _WeightedRows(torch.autograd.Function):
    """sum_i w_i * t_i over rows of `hidden`, where the terms t_i and their gradients with respect to each
    row were computed ahead (head_pass): backward scales each row's gradient by its weight w_i (chosen after
    the pass, detached) and the incoming scalar."""

    @staticmethod
    def forward(ctx, hidden, terms, row_grad, w):
        ctx.save_for_backward(row_grad, w)
        return (w * terms).sum()

    @staticmethod
    def backward(ctx, grad_total):
        row_grad, w = ctx.saved_tensors
        return (row_grad * (w * grad_total)[:, None]).to(row_grad.dtype), None, None, None


def block_loss(
    hidden: torch.Tensor,
    lm_head: torch.Tensor,
    labels: torch.Tensor,
    loss_weight: torch.Tensor,
    *,
    block_size: int,
    denom: float | torch.Tensor,
    topk_ids: torch.Tensor | None = None,
    topk_logprobs: torch.Tensor | None = None,
    kd_weight: float = 0.0,
    kd_temperature: float = 1.0,
    chunk: int = 2048,
    label_index: torch.Tensor | None = None,
    kernel: str = "eager",
    reweight: Callable[[torch.Tensor], torch.Tensor] | None = None,
    top_k: int = 0,
) -> LossOutput:
    """Loss and metrics of one micro-batch.

    hidden [R, Q, H] (the drafter's output), lm_head [V, H] (frozen), labels [R, Q] (IGNORE where
    there is nothing to predict), loss_weight [R, Q] (the decay weight, 0 where ignored), topk_* [R, Q, K]
    aligned with the labels.  `denom` normalises the loss (see the module docstring).  `label_index`
    (the flat positions whose label is not IGNORE, made on the CPU by the loader) saves the step a
    device-to-host sync.  `kernel` (KERNELS) computes each chunk's softmax / gradient; "triton" needs
    what `triton_runs` says (chunk_kernel picks a run's).  `reweight`, given each labelled row's
    cross-entropy [N] from the pass, returns the rows' weights instead of loss_weight's (D-PACE); `top_k`
    keeps each row's K best candidates in the output's `head` (a family's candidate selector reads them).
    """
    R, Q, H = hidden.shape
    flat_labels = labels.reshape(-1)
    sel = label_index if label_index is not None else (flat_labels != IGNORE).nonzero().squeeze(1)
    h = hidden.reshape(-1, H).index_select(0, sel)
    y = flat_labels.index_select(0, sel)
    kd_on = kd_weight > 0
    if kd_on and topk_ids is None:
        raise ValueError("kd_weight > 0 needs topk_ids and topk_logprobs")
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    if kernel == "triton" and not triton_runs(kd_on, hidden.device):
        raise ValueError("the Triton loss kernel needs KD off and a CUDA device (or TRITON_INTERPRET=1); "
                         "chunk_kernel picks the kernel that runs")
    tid = p = None
    if kd_on:
        tid = topk_ids.reshape(-1, topk_ids.shape[-1]).index_select(0, sel)
        lp = topk_logprobs.reshape(-1, topk_logprobs.shape[-1]).index_select(0, sel)
        p = torch.softmax(lp.float() / float(kd_temperature), dim=-1)
    # The head runs in its own dtype (bf16 on GPU) with fp32 softmax; autocast would only get in the way.
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        hp = head_pass(h.detach(), lm_head, y, topk_ids=tid, topk_p=p, kd_weight=float(kd_weight),
                       temperature=float(kd_temperature), chunk=int(chunk), kernel=kernel, top_k=int(top_k))
        w = (reweight(hp.ce) if reweight is not None else loss_weight.reshape(-1).index_select(0, sel)).float().detach()
        terms = hp.ce + float(kd_weight) * hp.kd if kd_on else hp.ce
        total = _WeightedRows.apply(h, terms, hp.grad, w)
    full_preds = torch.full((R * Q,), -1, dtype=torch.long, device=hidden.device)
    full_preds[sel] = hp.preds
    correct, valid, tau_sum, num_blocks = block_stats(full_preds.view(R, Q), labels, block_size)
    return LossOutput(
        loss=total / (denom.to(total.dtype) if isinstance(denom, torch.Tensor) else denom),
        ce_sum=(w * hp.ce).sum(),
        kd_sum=(w * hp.kd).sum() if kd_on else w.new_zeros(()),
        weight_sum=w.sum(),
        correct=correct,
        valid=valid,
        tau_sum=tau_sum,
        num_blocks=num_blocks,
        row_weight=w,
        head=hp,
    )


def reference_block_loss(hidden, lm_head, labels, loss_weight, denom, topk_ids=None, topk_logprobs=None,
                         kd_weight=0.0, kd_temperature=1.0):
    """The same objective with full logits and autograd: the yardstick for tests, not for training."""
    logits = (hidden.float() @ lm_head.float().t()).reshape(-1, lm_head.shape[0])
    y = labels.reshape(-1)
    valid = y != IGNORE
    w = loss_weight.reshape(-1).float()
    ce = F.cross_entropy(logits, y.clamp_min(0), reduction="none")
    total = (w * ce * valid).sum()
    if kd_weight > 0:
        T = kd_temperature
        p = torch.softmax(topk_logprobs.reshape(-1, topk_logprobs.shape[-1]).float() / T, -1)
        logq = torch.log_softmax(logits / T, -1).gather(1, topk_ids.reshape(-1, topk_ids.shape[-1]))
        kd = (p * (p.clamp_min(1e-30).log() - logq)).sum(-1) * T * T
        total = total + kd_weight * (w * kd * valid).sum()
    return total / denom


__all__ = ["IGNORE", "KERNELS", "chunk_kernel", "chunk_terms", "triton_runs", "chunk_terms_eager", "default_gamma",
           "position_weights", "HeadPass", "LossOutput", "block_loss", "block_stats", "block_acceptance", "head_pass",
           "loss_kernel_note", "reference_block_loss"]
