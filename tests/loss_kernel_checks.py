"""Checks of dflash.train.loss_kernel's Triton kernel on the CPU, through Triton's interpreter.

Triton binds its language functions to the interpreter when it is imported with TRITON_INTERPRET=1, so
these run in a fresh process started with it (tests/train/test_loss_kernel.py does that, once for all
checks): `python tests/loss_kernel_checks.py [name ...]` prints one JSON line {name: "ok" | traceback}.
"""

from __future__ import annotations

import json
import sys
import traceback

import torch

from dflash.train import loss_kernel
from dflash.train.loss import IGNORE, block_loss, chunk_kernel, chunk_terms_eager, reference_block_loss


def _chunk(c, V, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(c, V, generator=g) * 4
    x[0, [3, V // 2, V - 1]] = 40.0  # tie across tiles: the first index wins
    x[1, [V - 2, V - 1]] = 40.0  # tie in the last (partial) tile
    x[2, [7, 8]] = 40.0  # tie inside one tile
    labels = torch.randint(0, V, (c,), generator=g)
    labels[0], labels[1], labels[3] = 0, V - 1, 3  # first and last columns; a row labelled with its argmax
    x[3, 3] = 30.0
    w = torch.rand(c, generator=g) + 0.1
    w[[2, 4]] = 0.0  # weight 0: g must be 0, the prediction still right
    return x.to(dtype), labels, w


def _chunk_terms(dtype, c, V, block):
    x, y, w = _chunk(c, V, dtype, seed=c)
    ce_ref, _, preds_ref, g_ref = chunk_terms_eager(x.clone(), y, w, None, None, 0.0, 1.0)
    g_exact = chunk_terms_eager(x.float(), y, w, None, None, 0.0, 1.0)[3]  # fp32, before rounding
    ce, preds, g = loss_kernel.fused_ce_terms(x, y, w, block=block, num_warps=4)
    assert g.data_ptr() == x.data_ptr() and g.dtype == dtype and g.shape == (c, V)  # in place
    assert ce.dtype == torch.float32 and ce.shape == (c,)
    assert torch.allclose(ce, ce_ref, rtol=1e-5, atol=1e-5), (ce - ce_ref).abs().max()
    assert preds.dtype == torch.long and torch.equal(preds, preds_ref), (preds, preds_ref)
    assert preds[:3].tolist() == [3, V - 2, 7]
    assert g[[2, 4]].abs().max() == 0
    if dtype == torch.float32:
        assert torch.allclose(g, g_ref, rtol=1e-4, atol=1e-6), (g - g_ref).abs().max()
    else:  # within one bf16 ulp of the fp32 gradient: the interpreter's fp32 -> bf16 cast truncates where
        # the GPU rounds to nearest (as g_ref does), so the two can differ by one ulp
        err = (g.float() - g_exact).abs()
        assert (err <= g_exact.abs() * 2**-7).all(), err.max()


def _edge_cases():
    ce, preds, _ = loss_kernel.fused_ce_terms(torch.empty(0, 50), torch.empty(0, dtype=torch.long), torch.empty(0))
    assert ce.shape == (0,) and preds.shape == (0,)
    try:
        loss_kernel.fused_ce_terms(torch.randn(50, 4).t(), torch.zeros(4, dtype=torch.long), torch.ones(4))
    except ValueError:
        pass
    else:
        raise AssertionError("a transposed chunk was accepted")


def batch(R=2, B=4, nb=4, H=16, V=700, K=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    Q = nb * B + 2
    hidden = torch.randn(R, Q, H, generator=g)
    head = torch.randn(V, H, generator=g)
    labels = torch.randint(0, V, (R, Q), generator=g)
    pos = torch.arange(Q) % B
    labels[:, pos == 0] = IGNORE
    labels[:, nb * B:] = IGNORE
    weights = torch.exp(-(pos.float() - 1) / 2).expand(R, Q) * (labels != IGNORE)
    topk_ids = torch.randint(0, V, (R, Q, K), generator=g)
    topk_lp = torch.log_softmax(torch.randn(R, Q, K, generator=g), -1)
    return hidden, head, labels, weights, topk_ids, topk_lp, B


def _block_loss(kd_weight):
    """--loss-kernel triton through chunk_kernel and block_loss: the kernel for KD off (several chunks, several tiles a row),
    the usual path for KD on; loss and gradient as the full-logits reference gives them."""
    calls, real, block0 = [], loss_kernel.fused_ce_terms, loss_kernel.BLOCK
    loss_kernel.fused_ce_terms = lambda *a, **k: calls.append(1) or real(*a, **k)
    loss_kernel.BLOCK = 256
    try:
        hidden, head, labels, weights, tid, tlp, B = batch()
        denom = weights.sum() * 0.7
        h1 = hidden.clone().requires_grad_(True)
        out = block_loss(h1, head, labels, weights, block_size=B, denom=denom, topk_ids=tid, topk_logprobs=tlp,
                         kd_weight=kd_weight, kd_temperature=2.0, chunk=7,
                         kernel=chunk_kernel("triton", kd_weight > 0, hidden.device, compiled=False))
        (out.loss * 3.0).backward()
    finally:
        loss_kernel.fused_ce_terms, loss_kernel.BLOCK = real, block0
    h2 = hidden.clone().requires_grad_(True)
    ref = reference_block_loss(h2, head, labels, weights, float(denom), tid, tlp, kd_weight=kd_weight,
                               kd_temperature=2.0)
    (ref * 3.0).backward()
    assert len(calls) == (0 if kd_weight else 4), calls  # 24 labels in chunks of 7
    assert torch.allclose(out.loss, ref, rtol=1e-5), (float(out.loss), float(ref))
    assert torch.allclose(h1.grad, h2.grad, rtol=1e-4, atol=1e-6), (h1.grad - h2.grad).abs().max()
    eager = block_loss(hidden, head, labels, weights, block_size=B, denom=denom, topk_ids=tid, topk_logprobs=tlp,
                       kd_weight=kd_weight, kd_temperature=2.0, chunk=7)
    assert torch.equal(eager.correct, out.correct) and int(eager.tau_sum) == int(out.tau_sum)


CHECKS = {
    **{f"chunk_terms_{str(dt)[6:]}_c{c}_V{V}_block{b}": (lambda dt=dt, c=c, V=V, b=b: _chunk_terms(dt, c, V, b))
       for dt in (torch.float32, torch.bfloat16) for c, V, b in ((6, 1000, 256), (37, 2999, 512))},
    "edge_cases": _edge_cases,
    "block_loss_kd_off": lambda: _block_loss(0.0),
    "block_loss_kd_on_falls_back": lambda: _block_loss(0.5),
}


def main(names) -> None:
    results = {}
    if not loss_kernel.interpret_mode():
        results = {n: "TRITON_INTERPRET=1 is not set" for n in names}
    else:
        for n in names:
            try:
                CHECKS[n]()
                results[n] = "ok"
            except Exception:  # noqa: BLE001  (reported to the test, which fails with it)
                results[n] = traceback.format_exc()
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:] or list(CHECKS))
