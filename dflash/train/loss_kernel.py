"""One Triton kernel for a chunk's cross-entropy terms (KD off): what `loss.chunk_terms` computes, in
two passes over each row of bf16 logits, writing d loss / d logits over the logits themselves.

Why: at a 152k vocabulary the per-chunk softmax is memory-bound.  The minimum traffic is one read of the
logits and one write of the gradient (4 bytes per element in bf16); this kernel reads each row twice, but
the second read follows the first by one row's worth (~300 KB) per program, so with a program or two
per SM it mostly comes from L2 (60 MB on an H200).  Writing in place saves a [c, V] allocation, and
with it the caching allocator's churn on the biggest tensor of the step.

Semantics, row by row (label in [0, V), weight >= 0, as `block_loss` passes them):
  ce = logsumexp(x) - x[label]; pred = argmax(x), the first index of the maximum as torch.argmax
  documents it (strictly greater across tiles, lowest column within one); g = (softmax(x) - onehot) * w,
  in the logits' dtype, so a weight-0 row gets g = 0 and still a prediction.  A row holding NaN or
  only -inf gives undefined results (neither happens to logits out of a matmul).

Triton is optional: importing this module without it works, `available()` says whether the kernel can
run.  The kernel is jitted on first use, not at import, because Triton decides at decoration time
whether it runs compiled or interpreted (TRITON_INTERPRET=1: numpy on the CPU, for the tests).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton: dflash.train.loss keeps to its compiled path
    triton = tl = None

# Defaults for V ~ 152k bf16 on H100/H200: a tile is 16 fp32 values per thread, loop 1 runs ~19 tiles
# a row.  bench/loss_kernel.py times other choices.
BLOCK = 4096
NUM_WARPS = 8


def available() -> bool:
    return triton is not None


def interpret_mode() -> bool:
    """TRITON_INTERPRET as triton reads it: the kernel runs on CPU tensors (slowly)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _ce_rows(x_ptr, stride, labels_ptr, weights_ptr, ce_ptr, preds_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row * stride passes 2**31 at c = 16k, V = 152k
    x_row = x_ptr + row * stride
    label = tl.load(labels_ptr + row).to(tl.int32)
    w = tl.load(weights_ptr + row).to(tl.float32)
    cols = tl.arange(0, BLOCK)

    # Loop 1: running max and sum of exp(x - max) in fp32, rescaled when the max grows (one exp per
    # element and a tile-wide reduction, rather than per-lane state that needs two exps per element).
    m = float("-inf")
    s = 0.0
    best = 0
    for start in range(0, V, BLOCK):
        c = start + cols
        # evict_last: keep the row in L2 for loop 2
        x = tl.load(x_row + c, mask=c < V, other=float("-inf"), eviction_policy="evict_last").to(tl.float32)
        tile_max = tl.max(x, 0)
        if tile_max > m:  # a new maximum is rare after the first tiles: only then locate it
            best = tl.min(tl.where(x == tile_max, c, V), 0)
            s = s * tl.exp(m - tile_max)
            m = tile_max
        s += tl.sum(tl.exp(x - m), 0)
    # logsumexp = m + log_s, kept apart: folding m in rounds away log_s when the row is nearly one-hot
    # (m = 30, log_s = 1e-6), and then a confident right prediction would get g = 0 instead of p - 1.
    log_s = tl.log(s)
    x_label = tl.load(x_row + label).to(tl.float32)
    tl.store(ce_ptr + row, (m - x_label) + log_s)
    tl.store(preds_ptr + row, best.to(tl.int64))

    # Loop 2: the gradient over the logits just read.  Each program owns its row, so writing in place
    # cannot race with another program's reads.
    for start in range(0, V, BLOCK):
        c = start + cols
        x = tl.load(x_row + c, mask=c < V, other=0.0, eviction_policy="evict_first").to(tl.float32)
        g = (tl.exp((x - m) - log_s) - tl.where(c == label, 1.0, 0.0)) * w
        tl.store(x_row + c, g.to(x_ptr.dtype.element_ty), mask=c < V)


_JITTED = {}


def _kernel():
    key = interpret_mode()
    if key not in _JITTED:
        _JITTED[key] = triton.jit(_ce_rows)
    return _JITTED[key]


def fused_ce_terms(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, *,
                   block: int | None = None, num_warps: int | None = None):
    """(ce fp32 [c], preds int64 [c], g) for logits [c, V] (any float dtype, last dim contiguous).  g IS `logits`, overwritten with (softmax - onehot) * w: the caller must not
    need the logits afterwards."""
    if triton is None:
        raise RuntimeError("fused_ce_terms needs triton")
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [c, V] with a contiguous last dim, got {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    c, V = logits.shape
    labels, weights = labels.contiguous(), weights.float().contiguous()
    ce = torch.empty(c, dtype=torch.float32, device=logits.device)
    preds = torch.empty(c, dtype=torch.long, device=logits.device)
    if c:
        _kernel()[(c,)](logits, logits.stride(0), labels, weights, ce, preds, V,
                        BLOCK=block or BLOCK, num_warps=num_warps or NUM_WARPS)
    return ce, preds, logits


__all__ = ["BLOCK", "NUM_WARPS", "available", "fused_ce_terms", "interpret_mode"]
