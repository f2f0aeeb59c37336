"""TrainConfig.loss_norm: the step's gradient under "step" (the global weighted mean: the default) and
"micro_batch" (each micro-batch's own weighted mean, averaged), through TrainStep itself."""

from __future__ import annotations

import pytest
import torch
from test_acceptance_semantics import MASK_ID, B, H, V, dataset

from dflash.config import TrainConfig
from dflash.drafter import DrafterConfig
from dflash.train.step import TrainStep


class _Feeder:
    def ready(self, item):
        return item[0]

    def prefetch(self):
        pass


def _step(loss_norm: str, micro: list):
    cfg = TrainConfig(block_size=B, num_layers=2, compile="off", grad_clip=0.0, grad_accum=len(micro),
                      loss_norm=loss_norm, seed=3)
    dcfg = DrafterConfig(hidden_size=H, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=8, intermediate_size=32, vocab_size=V, num_target_layers=4,
                         target_layer_ids=[1, 2], mask_token_id=MASK_ID, block_size=B, rope_theta=10000.0)
    g = torch.Generator().manual_seed(5)
    embed, head = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g)
    return TrainStep(dcfg, cfg, torch.device("cpu"), 1, embed, head)


def _grads(ts) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in ts.raw.parameters()])


@pytest.mark.parametrize("loss_norm", ["step", "micro_batch"])
def test_loss_norm_gives_the_gradient_it_names(loss_norm):
    ds = dataset(rows_per_batch=1, token_budget=128)
    micro = [ds.build(0, rows, i) for i, rows in enumerate(ds.plan(0).batches[:3])]
    sums = [b.loss_weight_sum for b in micro]
    assert max(sums) > 1.3 * min(sums)  # the micro-batches differ in weight: normalisation matters
    micro = [b.map_tensors(lambda v: v.float() if v.is_floating_point() else v) for b in micro]
    ts = _step(loss_norm, micro)
    expected = {}
    for mode, denoms in (("step", [sum(sums)] * 3), ("micro_batch", [s * 3 for s in sums])):
        ts.optimizer.zero_grad(set_to_none=True)
        for b, d in zip(micro, denoms):
            ts.forward_backward(b, d)
        expected[mode] = _grads(ts)
    ts.optimizer.zero_grad(set_to_none=True)
    got = []
    ts.optimizer.step = lambda: got.append(_grads(ts))  # the gradient the optimizer would apply
    ts([(b, None) for b in micro], _Feeder(), lr=1e-3, prefetch=False)
    torch.testing.assert_close(got[0], expected[loss_norm], rtol=1e-5, atol=1e-8)
    other = expected["micro_batch" if loss_norm == "step" else "step"]
    assert not torch.allclose(got[0], other, rtol=1e-2)


def test_one_micro_batch_makes_both_the_same():
    ds = dataset(rows_per_batch=1, token_budget=128)
    b = ds.build(0, ds.plan(0).batches[0], 0)
    b = b.map_tensors(lambda v: v.float() if v.is_floating_point() else v)
    out = []
    for mode in ("step", "micro_batch"):
        ts = _step(mode, [b])
        ts.optimizer.step = lambda ts=ts: out.append(_grads(ts))
        ts([(b, None)], _Feeder(), lr=1e-3, prefetch=False)
    torch.testing.assert_close(out[0], out[1])
