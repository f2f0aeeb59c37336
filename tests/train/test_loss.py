"""The chunked lm_head loss against a plain full-logits autograd reference."""

import math

import pytest
import torch

from dflash.train.loss import IGNORE, block_loss, block_stats, default_gamma, position_weights, reference_block_loss


def test_gamma_and_weights():
    assert default_gamma(16) == 7 and default_gamma(10) == 5 and default_gamma(8) == 4
    w = position_weights(16)
    assert w[0] == 0 and w[1] == 1
    assert math.isclose(float(w[8]), math.exp(-7 / 7), rel_tol=1e-6)
    assert math.isclose(float(position_weights(8, gamma=2.0)[3]), math.exp(-1.0), rel_tol=1e-6)


def _batch(R=2, B=4, nb=5, H=8, V=50, K=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    Q = nb * B + 3  # padding at the end of each row
    hidden = torch.randn(R, Q, H, generator=g, dtype=torch.float64)
    head = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (R, Q), generator=g)
    pos = torch.arange(Q) % B
    labels[:, pos == 0] = IGNORE
    labels[:, nb * B :] = IGNORE
    labels[0, 7] = IGNORE  # a label past the sample end
    weights = position_weights(B)[pos].expand(R, Q).clone().double() * (labels != IGNORE)
    topk_ids = torch.randint(0, V, (R, Q, K), generator=g)
    topk_lp = torch.log_softmax(torch.randn(R, Q, K, generator=g), -1)
    return hidden, head, labels, weights, topk_ids, topk_lp, B


@pytest.mark.parametrize("kd_weight", [0.0, 0.5])
@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_chunked_matches_reference(kd_weight, chunk):
    hidden, head, labels, weights, tid, tlp, B = _batch()
    denom = float(weights.sum()) * 0.7
    h1 = hidden.clone().requires_grad_(True)
    out = block_loss(h1, head, labels, weights, block_size=B, denom=denom, topk_ids=tid, topk_logprobs=tlp,
                     kd_weight=kd_weight, kd_temperature=2.0, chunk=chunk)
    (out.loss * 3.0).backward()
    h2 = hidden.clone().requires_grad_(True)
    ref = reference_block_loss(h2, head, labels, weights, denom, tid, tlp, kd_weight=kd_weight, kd_temperature=2.0)
    (ref * 3.0).backward()
    assert torch.allclose(out.loss, ref, rtol=1e-5)
    assert torch.allclose(h1.grad, h2.grad, rtol=1e-4, atol=1e-8)
    assert h1.grad[labels == IGNORE].abs().max() == 0  # ignored positions get no gradient
    if kd_weight == 0:
        assert float(out.kd_sum) == 0
    else:
        assert float(out.kd_sum) > 0


def test_block_stats_tau():
    B = 4
    labels = torch.tensor([[IGNORE, 5, 6, 7, IGNORE, 1, 2, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE]])
    preds = torch.tensor([[0, 5, 6, 0, 0, 1, 0, 9, 0, 0, 0, 0]])
    correct, valid, tau_sum, nblocks = block_stats(preds, labels, B)
    # block 0: correct, correct, wrong -> tau 3; block 1: correct, wrong -> 2; block 2: padding
    assert int(nblocks) == 2 and int(tau_sum) == 5
    assert correct.tolist() == [0, 2, 1, 0] and valid.tolist() == [0, 2, 2, 1]
    # an ignored label stops the run: the prediction past the sample end never counts
    labels2 = torch.tensor([[IGNORE, 5, IGNORE, IGNORE]])
    assert int(block_stats(torch.tensor([[0, 5, 3, 3]]), labels2, B)[2]) == 2


@pytest.mark.parametrize("kd_weight", [0.0, 0.5])
def test_fused_compiled_loss_matches_reference(kd_weight):
    """The compiled per-chunk softmax/gradient (what training runs on GPU) against the full-logits
    reference, with a short last chunk (dynamic rows: no recompile), CPU-made label positions and a
    tensor denominator (no host sync in the step)."""
    from torch._dynamo.utils import counters

    hidden, head, labels, weights, tid, tlp, B = _batch(V=64)
    hidden, head, weights = hidden.float(), head.float(), weights.float()
    denom = weights.sum() * 0.7
    sel = (labels.reshape(-1) != IGNORE).nonzero().squeeze(1)
    outs, grads = [], []
    frames = []
    for chunk in (8, 8, 5):  # 8: full chunks + a short tail; 5: another tail length
        h = hidden.clone().requires_grad_(True)
        out = block_loss(h, head, labels, weights, block_size=B, denom=denom, topk_ids=tid, topk_logprobs=tlp,
                         kd_weight=kd_weight, kd_temperature=2.0, chunk=chunk, label_index=sel, kernel="compiled")
        out.loss.backward()
        outs.append(out)
        grads.append(h.grad)
        frames.append(counters["frames"]["total"])
    h2 = hidden.clone().requires_grad_(True)
    ref = reference_block_loss(h2, head, labels, weights, float(denom), tid, tlp, kd_weight=kd_weight,
                               kd_temperature=2.0)
    ref.backward()
    for out, g in zip(outs, grads):
        assert torch.allclose(out.loss, ref.float(), rtol=1e-4)
        assert torch.allclose(g, h2.grad, rtol=1e-3, atol=1e-6)
    assert frames[1] == frames[0]  # the same chunk sizes again: no new compilation
    eager = block_loss(hidden, head, labels, weights, block_size=B, denom=denom, topk_ids=tid, topk_logprobs=tlp,
                       kd_weight=kd_weight, kd_temperature=2.0, chunk=8)
    assert torch.equal(eager.correct, outs[0].correct) and int(eager.tau_sum) == int(outs[0].tau_sum)


@pytest.mark.parametrize("kd_weight", [0.0, 0.5])
def test_eager_and_fusible_chunk_terms_agree(kd_weight):
    """The two forms of one chunk's terms (in-place eager, and the one torch.compile fuses) agree."""
    from dflash.train.loss import chunk_terms, chunk_terms_eager

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 40, generator=g) * 3
    labels = torch.randint(0, 40, (9,), generator=g)
    w = torch.rand(9, generator=g)
    ids = torch.randint(0, 40, (9, 4), generator=g)
    p = torch.softmax(torch.randn(9, 4, generator=g), -1) if kd_weight else None
    a = chunk_terms(logits, labels, w, ids, p, kd_weight, 2.0)
    b = chunk_terms_eager(logits, labels, w, ids, p, kd_weight, 2.0)
    for x, y in zip(a, b):
        assert torch.allclose(x.float(), y.float(), rtol=1e-5, atol=1e-6)


def test_loss_kernel_note_says_which_kernel_runs_and_why_not_triton():
    """The banner's account of the per-chunk kernel: the Triton kernel falls back silently otherwise."""
    from dflash.train import loss_kernel
    from dflash.train.loss import loss_kernel_note

    cpu = torch.device("cpu")
    assert loss_kernel_note("compiled", False, cpu) == "torch"
    assert loss_kernel_note("triton", True, cpu).endswith("falls back: KD is on)")
    expected = "no CUDA device" if loss_kernel.available() else "triton is not installed"
    if not loss_kernel.interpret_mode():
        assert loss_kernel_note("triton", False, cpu).endswith(f"falls back: {expected})")
    with pytest.raises(ValueError, match="compiled' or 'triton"):
        loss_kernel_note("fast", False, cpu)
