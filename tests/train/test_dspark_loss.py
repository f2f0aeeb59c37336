"""DSpark's loss terms against a dense, loop-based reference written from their definitions (docs/DESIGN.md
§12), and the target distribution recomputed from the final hidden state against the target's own forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash.drafter import DrafterConfig, build_drafter, with_arch
from dflash.drafter.dspark.loss import dspark_block_loss, target_logprobs
from dflash.drafter.labels import previous_tokens
from dflash.train.loss import IGNORE, position_weights

B, V, H = 4, 50, 16


def _drafter(**knobs):
    cfg = DrafterConfig(hidden_size=H, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                        intermediate_size=32, vocab_size=V, num_target_layers=4, target_layer_ids=[1, 2],
                        mask_token_id=V - 1, block_size=B)
    torch.manual_seed(0)
    return build_drafter(with_arch(cfg, "dspark", markov_rank=6, **knobs))


def _batch(seed=0):
    """Two rows of three blocks; some labels ignored (one inside a block, so its successor has no predecessor)."""
    g = torch.Generator().manual_seed(seed)
    R, Q = 2, 3 * B
    labels = torch.randint(0, V - 1, (R, Q), generator=g)
    labels[:, ::B] = IGNORE  # anchors predict nothing
    labels[0, 6] = IGNORE
    labels[1, 9:] = IGNORE  # padding
    inputs = torch.full((R, Q), V - 1)
    inputs[:, ::B] = torch.randint(0, V - 1, (R, 3), generator=g)
    w = position_weights(B, 2.0).repeat(3).expand(R, Q) * (labels != IGNORE)
    hidden = torch.randn(R, Q, H, generator=g, requires_grad=True)
    head = torch.randn(V, H, generator=g) * 0.3
    return hidden, head, labels, inputs, w, g


def _reference(drafter, hidden, head, labels, inputs, w, p_of, ce_w, tv_w, c_w):
    """Loop over every block position: the previous true token, the biased logits, the three terms."""
    total = hidden.new_zeros(())
    R, Q = labels.shape
    for r in range(R):
        for q in range(Q):
            y = int(labels[r, q])
            if y == IGNORE:
                continue
            k = q % B
            prev = int(inputs[r, q - 1]) if k == 1 else int(labels[r, q - 1])
            if prev == IGNORE:  # no true previous token: no supervision (DeepSpec's contiguous prefix)
                continue
            m = drafter.markov_head
            z = hidden[r, q] @ head.t() + m.markov_w2.weight @ m.markov_w1.weight[prev]
            logq = torch.log_softmax(z, -1)
            p = p_of(r, q)
            l1 = sum(abs(float(0) + logq[v].exp() - p[v]) for v in range(V))
            a = float(min(max(1 - 0.5 * l1.detach(), 0.0), 1.0))
            feat = torch.cat([hidden[r, q], m.markov_w1.weight[prev]])
            c = drafter.confidence_head.proj(feat)[0]
            bce = -(a * F.logsigmoid(c) + (1 - a) * F.logsigmoid(-c))
            total = total + w[r, q] * (ce_w * -logq[y] + tv_w * l1 + c_w * bce)
    return total


@pytest.mark.parametrize("source", ["final_hidden", "topk"])
def test_loss_and_gradients_match_the_loop_reference(source):
    drafter = _drafter()
    with torch.no_grad():  # away from the init, so that every term matters
        drafter.markov_head.markov_w2.weight.normal_(0, 0.5)
        drafter.confidence_head.proj.weight.normal_(0, 0.5)
    hidden, head, labels, inputs, w, g = _batch()
    R, Q = labels.shape
    final = torch.randn(R, Q, H, generator=g)
    norm_w = torch.rand(H, generator=g) + 0.5
    K = 5
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(R * Q)]).view(R, Q, K)
    lps = torch.randn(R, Q, K, generator=g)
    if source == "final_hidden":
        def p_of(r, q):
            x = final[r, q]
            h = x * torch.rsqrt(x.pow(2).mean() + 1e-6) * norm_w
            return torch.softmax(h @ head.t(), -1)
    else:
        def p_of(r, q):
            p = torch.zeros(V)
            p[ids[r, q]] = torch.softmax(lps[r, q], -1)
            return p
    prev = previous_tokens(labels, inputs, B)
    denom = 3.5
    out = dspark_block_loss(drafter, hidden, head, labels, w, prev, block_size=B, denom=denom, ce_weight=0.1,
                            tv_weight=0.9, confidence_weight=1.0, tv_source=source, final_hidden=final,
                            norm_weight=norm_w, topk_ids=ids, topk_logprobs=lps, chunk=5)
    grads = torch.autograd.grad(out.loss, [hidden, *drafter.parameters()], allow_unused=True)
    ref = _reference(drafter, hidden, head, labels, inputs, w, p_of, 0.1, 0.9, 1.0) / denom
    want = torch.autograd.grad(ref, [hidden, *drafter.parameters()], allow_unused=True)
    torch.testing.assert_close(out.loss, ref, rtol=1e-5, atol=1e-6)
    assert float(out.tv_sum) > 0 and float(out.conf_sum) > 0
    for a, b in zip(grads, want):
        if b is None:
            assert a is None or float(a.abs().max()) == 0
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert float(grads[0].abs().sum()) > 0


def test_predictions_are_the_markov_biased_argmax_and_tau_counts_them():
    drafter = _drafter(enable_confidence_head=False)
    hidden, head, labels, inputs, w, _ = _batch(1)
    prev = previous_tokens(labels, inputs, B)
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.normal_(0, 3.0)  # a bias strong enough to change the argmax
        out = dspark_block_loss(drafter, hidden, head, labels, w, prev, block_size=B, denom=1.0, ce_weight=1.0,
                                tv_weight=0.0, confidence_weight=1.0, tv_source="topk",
                                topk_ids=torch.zeros(*labels.shape, 1, dtype=torch.long),
                                topk_logprobs=torch.zeros(*labels.shape, 1))
    assert float(out.conf_sum) == 0  # no confidence head: no term
    lab = labels != IGNORE
    z = drafter.head_logits(hidden[lab], head, prev[lab].clamp_min(0)).argmax(-1)
    assert int(out.correct.sum()) == int((z == labels[lab]).sum())
    assert (z != (hidden[lab] @ head.t()).argmax(-1)).any()  # the bias is applied


def test_target_distribution_from_final_hidden_equals_the_targets_own_forward(tmp_path):
    from dflash.target_model.capture import load_target
    from dflash.target_model.files import load_embed_and_head, load_final_norm
    from helpers import make_tiny_target

    target_dir = make_tiny_target(tmp_path)
    model = load_target(target_dir, torch.float32, torch.device("cpu"))
    layers = model.get_decoder().layers
    seen = {}
    hook = layers[-1].register_forward_hook(lambda m, a, o: seen.update(h=o[0] if isinstance(o, tuple) else o))
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    hook.remove()
    _, head = load_embed_and_head(target_dir)
    got = target_logprobs(seen["h"][0], load_final_norm(target_dir).float(), head.float(), model.config.rms_norm_eps)
    torch.testing.assert_close(got, torch.log_softmax(logits.float(), -1), rtol=1e-5, atol=1e-5)
