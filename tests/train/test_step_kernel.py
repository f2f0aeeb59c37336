"""TrainStep reads the loss kernel from its config at every step (as before the house, issue 33): a caller
that changes cfg.objective.loss_kernel after building the step, as bench/train_step.py's loss=triton
variants do, gets that kernel, not the one the build saw."""

from __future__ import annotations

import torch
from test_acceptance_semantics import dataset
from test_loss_norm import _Feeder, _step

from dflash.train import loss as dloss
from dflash.train import step as dstep


def test_step_uses_the_loss_kernel_the_config_names_now(monkeypatch):
    ds = dataset(rows_per_batch=1, token_budget=128)
    micro = [ds.build(0, ds.plan(0).batches[0], 0).map_tensors(lambda v: v.float() if v.is_floating_point() else v)]
    ts = _step("step", micro)
    assert ts.cfg.objective.loss_kernel == "triton" and ts.loss_kernel == "eager"  # no CUDA: torch's, eager
    monkeypatch.setattr(dloss, "triton_runs", lambda use_kd, device: not use_kd)  # as if on CUDA
    seen = []

    def block_loss(*a, kernel, **k):
        seen.append(kernel)
        return dloss.block_loss(*a, kernel="eager", **k)  # the values are the same; the Triton one is slow here

    monkeypatch.setattr(dstep, "block_loss", block_loss)
    ts.cfg.objective.loss_kernel = "compiled"
    ts([(micro[0], None)], _Feeder(), lr=1e-3, prefetch=False)
    ts.cfg.objective.loss_kernel = "triton"
    ts([(micro[0], None)], _Feeder(), lr=1e-3, prefetch=False)
    ts.cfg.objective.kd_weight = 0.5  # KD on: the Triton kernel cannot, torch's runs
    assert ts.loss_kernel == "eager"
    assert seen == ["eager", "triton"]
    assert torch.isfinite(torch.cat([p.reshape(-1) for p in ts.raw.parameters()])).all()
