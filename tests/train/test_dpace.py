"""D-PACE weights and the DFlash2 selector's K-way cross-entropy on hand-made cases (docs/DESIGN.md §11),
and one short `--arch dflash2 --loss dpace` run through the trainer, resumed with another --arch: refused.

D-PACE as verl-project/verl-SpeCo `verl_speco/backends/dpace_loss.py` computes it (arXiv 2605.18810);
the selector loss as verl-SpeCo `verl_speco/backends/dflash2_trainer_backend.py` (`_auxiliary_loss`) does."""

from __future__ import annotations

import math

import pytest
import torch

from dflash.drafter.dflash2.loss import Prepass, selector_ce
from dflash.drafter.labels import previous_tokens
from dflash.train.loss import IGNORE
from dflash.train.objectives import dpace_loss_weight, dpace_weights


def test_dpace_weights_by_hand():
    # one block of 4: the anchor (no label), then label probabilities 1/2, 1/4, 1
    ce = -torch.log(torch.tensor([[1.0, 0.5, 0.25, 1.0]]))
    valid = torch.tensor([[False, True, True, True]])
    # alpha 0: prefix products 1/2, 1/8, 1/8; weights = suffix sums 3/4, 1/4, 1/8
    assert torch.allclose(dpace_weights(ce, valid, 0.0), torch.tensor([[0.0, 0.75, 0.25, 0.125]]))
    # alpha 1/2: s = 3/4, 5/8, 1; prefixes 3/4, 15/32, 15/32
    want = torch.tensor([[0.0, 0.75 + 15 / 32 + 15 / 32, 15 / 32 + 15 / 32, 15 / 32]])
    assert torch.allclose(dpace_weights(ce, valid, 0.5), want)
    # an unlabelled position in the middle (not supervised) is neutral in the product and weighs 0
    hole = torch.tensor([[False, True, False, True]])
    assert torch.allclose(dpace_weights(ce, hole, 0.0), torch.tensor([[0.0, 0.5 + 0.5, 0.0, 0.5]]))
    with pytest.raises(ValueError, match="dpace_alpha"):
        dpace_weights(ce, valid, 1.5)


def test_dpace_weights_are_the_gradient_of_expected_acceptance():
    """With alpha = 0, w_k = d/d(log p_k) of sum_j prod_{i <= j} p_i, the surrogate the paper derives them from."""
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(3, 6, generator=g) * 2).requires_grad_(True)
    valid = torch.ones(3, 6, dtype=torch.bool)
    torch.cumprod(logp.exp(), -1).sum().backward()
    assert torch.allclose(dpace_weights(-logp.detach(), valid, 0.0), logp.grad, atol=1e-6)


def test_dpace_loss_weight_keeps_the_layout_and_the_decay_sum():
    B = 4
    labels = torch.tensor([[IGNORE, 5, 6, 7, IGNORE, 8, 9, IGNORE]])  # two blocks, the second cut short
    decay = torch.tensor([[0.0, 1.0, 0.7, 0.5, 0.0, 1.0, 0.7, 0.0]])
    sel = (labels.reshape(-1) != IGNORE).nonzero().squeeze(1)
    ce = torch.tensor([0.1, 2.0, 0.3, 0.2, 0.4])  # in label order
    w = dpace_loss_weight(ce, labels, decay, sel, B, alpha=0.5)
    assert torch.allclose(w.sum(), decay.sum())
    assert (w[labels == IGNORE] == 0).all() and (w[labels != IGNORE] > 0).all()
    raw = dpace_weights(torch.tensor([[0, 0.1, 2.0, 0.3], [0, 0.2, 0.4, 0]]),
                        torch.tensor([[False, True, True, True], [False, True, True, False]]), 0.5)
    assert torch.allclose(w.view(2, 4), raw * decay.sum() / raw.sum())


def test_previous_tokens_are_the_anchor_then_the_true_tokens():
    labels = torch.tensor([[IGNORE, 11, 12, 13, IGNORE, 21, 22, IGNORE]])
    block_in = torch.tensor([[10, 99, 99, 99, 20, 99, 99, 99]])  # [anchor, MASK, ...] per block
    assert previous_tokens(labels, block_in, 4).tolist() == [[IGNORE, 10, 11, 12, IGNORE, 20, 21, 22]]


class _Selector:
    """dflash.drafter.dflash2.CandidateSelector's scores with hand-set tables (vocab 4, rank 1)."""

    def __init__(self):
        from dflash.drafter.dflash2 import CandidateSelector

        self.m = CandidateSelector(hidden=2, vocab=4, rank=1, top_k=3)
        with torch.no_grad():
            self.m.predecessor_codebook.copy_(torch.tensor([[1.0], [2.0], [0.0], [-1.0]]))
            self.m.successor_codebook.copy_(torch.tensor([[0.0], [1.0], [2.0], [3.0]]))
            self.m.hidden_projection.weight.copy_(torch.tensor([[1.0, 0.0]]))

    def scores(self, *a):
        return self.m.scores(*a)


def test_selector_cross_entropy_by_hand():
    sel = _Selector()
    hidden = torch.tensor([[1.0, 5.0], [0.5, 0.0], [1.0, 0.0], [1.0, 0.0]])  # projection: 1, 0.5, 1, 1
    ids = torch.tensor([[1, 2, 3], [3, 0, 1], [0, 1, 2], [1, 2, 3]])
    unary = torch.tensor([[2.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    y = torch.tensor([2, 1, 3, 1])  # row 2: the label is not among the candidates
    prev = torch.tensor([1, 0, 0, IGNORE])  # row 3: no known predecessor
    w = torch.tensor([1.0, 0.5, 1.0, 1.0])
    total, preds, learn = selector_ce(sel, hidden, Prepass(torch.zeros(4), unary, ids), y, prev, w)
    # row 0: prev 1 -> context 2 * 1 = 2; scores 2 + 2*1, 1 + 2*2, 0 + 2*3 = [4, 5, 6]; label 2 at index 1
    s0 = torch.tensor([4.0, 5.0, 6.0])
    # row 1: prev 0 -> context 1 * 0.5; scores 1 + 1.5, 0 + 0, 0 + 0.5 = [2.5, 0, 0.5]; label 1 at index 2
    s1 = torch.tensor([2.5, 0.0, 0.5])
    ce0 = torch.logsumexp(s0, 0) - s0[1]
    ce1 = torch.logsumexp(s1, 0) - s1[2]
    assert learn.tolist() == [True, True, False, False]
    assert math.isclose(float(total.detach()), float(ce0 + 0.5 * ce1), rel_tol=1e-6)
    assert preds[:2].tolist() == [3, 3]  # the argmax candidates: id 3 (score 6), id 3 (score 2.5)


def test_dflash2_dpace_run_and_resume_with_another_arch_is_refused(tmp_path):
    import json

    from dflash.config import TrainConfig
    from dflash.errors import ConfigError
    from dflash.train.launch import launch_train
    from train_fixtures import build_counting_store

    target, store = build_counting_store(tmp_path / "data", n=16, teach=False)
    base = dict(store=str(store), target=str(target), out=str(tmp_path / "run"), gpus="cpu:1", block_size=8,
                num_layers=1, steps=3, lr=3e-3, warmup_steps=1, token_budget=256, num_anchors=8, num_workers=1,
                compile="off", seed=0, save_every=0, arch="dflash2", loss="dpace", selector_rank=8,
                selector_top_k=4, conv_kernel_size=3)
    final = launch_train(TrainConfig(**base))
    assert final["steps"] == 3 and math.isfinite(final["loss"]) and 1.0 <= final["tau"] <= 8
    ckpt = sorted((tmp_path / "run" / "checkpoints").iterdir())[-1]
    saved = json.loads((ckpt / "config.json").read_text())
    assert saved["architectures"] == ["DFlash2DraftModel"] and saved["dflash_config"]["conv_kernel_size"] == 3
    with pytest.raises(ConfigError, match="dflash2 drafter and this run asks for --arch dflash"):
        launch_train(TrainConfig(**dict(base, arch="dflash", steps=4, resume=True)))
    with pytest.raises(ConfigError, match="selector_rank"):
        launch_train(TrainConfig(**dict(base, selector_rank=16, steps=4, resume=True)))


def _blocks_batch(R=2, B=4, nb=5, H=16, V=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    Q = nb * B
    hidden = torch.randn(R, Q, H, generator=g)
    head = torch.randn(V, H, generator=g) * 0.5
    labels = torch.randint(0, V, (R, Q), generator=g)
    k = torch.arange(Q) % B
    labels[:, k == 0] = IGNORE
    labels[1, 13:] = IGNORE  # a block cut short, then padding
    decay = torch.exp(-(k.float() - 1) / 2).expand(R, Q) * (labels != IGNORE)
    block_in = torch.where(k == 0, torch.randint(0, V, (R, Q), generator=g), torch.full((R, Q), V - 1))
    tid = torch.randint(0, V, (R, Q, 3), generator=g)
    tlp = torch.log_softmax(torch.randn(R, Q, 3, generator=g), -1)
    return hidden, head, labels, decay, block_in, tid, tlp, B


@pytest.mark.parametrize("kd_weight", [0.0, 0.5])
def test_one_head_pass_gives_the_dpace_loss_and_gradient(kd_weight):
    """block_loss's one lm_head pass with D-PACE weights chosen after it (`reweight`) gives the loss and the
    gradient of the objective written out with full logits: D-PACE weights from the rows' detached CE,
    then the weighted CE (+ KD)."""
    from dflash.train.loss import block_loss, reference_block_loss

    hidden, head, labels, decay, _, tid, tlp, B = _blocks_batch()
    sel = (labels.reshape(-1) != IGNORE).nonzero().squeeze(1)
    denom = float(decay.sum()) * 0.8
    h1 = hidden.clone().requires_grad_(True)
    out = block_loss(h1, head, labels, decay, block_size=B, denom=denom, topk_ids=tid, topk_logprobs=tlp,
                     kd_weight=kd_weight, kd_temperature=2.0, chunk=7, label_index=sel,
                     reweight=lambda ce: dpace_loss_weight(ce, labels, decay, sel, B, 0.5).reshape(-1)[sel])
    out.loss.backward()

    h2 = hidden.clone().requires_grad_(True)
    logits = (h2.detach().reshape(-1, h2.shape[-1])[sel] @ head.t())
    ce = torch.logsumexp(logits, -1) - logits.gather(1, labels.reshape(-1)[sel, None]).squeeze(1)
    w = dpace_loss_weight(ce, labels, decay, sel, B, 0.5)
    ref = reference_block_loss(h2, head, labels, w, denom, tid, tlp, kd_weight=kd_weight, kd_temperature=2.0)
    ref.backward()
    assert not torch.allclose(w, decay)  # D-PACE moved the weights: the check below is not the decay's
    assert torch.allclose(out.row_weight, w.reshape(-1)[sel])
    assert torch.allclose(out.loss, ref, rtol=1e-5), (float(out.loss), float(ref))
    assert torch.allclose(h1.grad, h2.grad, rtol=1e-4, atol=1e-6), (h1.grad - h2.grad).abs().max()


def test_dflash2_selector_term_from_the_same_pass():
    """With top_k, the pass keeps the candidates a DFlash2 selector scores: the selector's term and its
    gradient equal those from a separate top-K pass over the full logits (head_prepass)."""
    from dflash.drafter import DrafterConfig, build_drafter, with_arch
    from dflash.drafter.dflash2.loss import add_selector_term, head_prepass
    from dflash.train.loss import block_loss

    hidden, head, labels, decay, block_in, _, _, B = _blocks_batch(V=64)
    cfg = DrafterConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=8, intermediate_size=32, vocab_size=64, num_target_layers=4, target_layer_ids=[1, 2],
                        mask_token_id=63, block_size=B)
    drafter = build_drafter(with_arch(cfg, "dflash2", selector_rank=4, selector_top_k=5))
    top1 = (hidden @ head.t()).argmax(-1)
    labels = torch.where((labels != IGNORE) & (torch.arange(labels.shape[1]) % 2 == 0), top1, labels)  # some hits
    sel = (labels.reshape(-1) != IGNORE).nonzero().squeeze(1)
    out = block_loss(hidden, head, labels, decay, block_size=B, denom=3.0, chunk=7, label_index=sel, top_k=5)
    got = add_selector_term(out, drafter, hidden, labels, block_in, sel, block_size=B, denom=3.0)
    (got.loss - out.loss).backward()
    grads = [p.grad.clone() for p in drafter.candidate_selector.parameters()]
    drafter.zero_grad()

    pre = head_prepass(hidden, head, labels, sel, 7, selector_of=drafter, ce=False)
    prev = previous_tokens(labels, block_in, B).reshape(-1)[sel]
    ref, _, learn = selector_ce(drafter.candidate_selector, hidden.reshape(-1, 16)[sel], pre, labels.reshape(-1)[sel],
                                prev, decay.reshape(-1)[sel])
    (ref / 3.0).backward()
    assert learn.any() and torch.equal(out.head.top_ids, pre.ids)
    assert torch.allclose(got.loss - out.loss, ref / 3.0, rtol=1e-5)
    assert all(torch.allclose(a, p.grad, rtol=1e-5, atol=1e-7)
               for a, p in zip(grads, drafter.candidate_selector.parameters()))
