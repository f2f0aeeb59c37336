"""MicroBatch across the process boundary and through the DataLoader's pinning; Packer row by row."""

from __future__ import annotations

import dataclasses
import pickle

import torch
from test_acceptance_semantics import dataset
from torch.utils.data._utils.pin_memory import pin_memory

from dflash.train.batch import MicroBatch


def _same(a: MicroBatch, b: MicroBatch) -> None:
    for f in dataclasses.fields(MicroBatch):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), f.name
        elif isinstance(x, dict):
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), f.name
        else:
            assert x == y, f.name


def _batch() -> MicroBatch:
    ds = dataset(rows_per_batch=2, token_budget=128)
    return ds.build(0, ds.plan(0).batches[0], 0)


def test_a_micro_batch_pickles_whole():
    b = _batch()
    assert b.num_samples > 1 and b.ctx_hidden is not None
    _same(b, pickle.loads(pickle.dumps(b)))


def test_the_dataloader_pins_every_tensor_through_pin_memory(monkeypatch):
    # DataLoader(pin_memory=True) hands a batch of a type it does not know to its pin_memory method; a
    # CPU-only torch cannot page-lock, so a clone stands in for the page-locked copy.
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **kw: self.clone())
    b = _batch()
    pinned = pin_memory(b)
    assert isinstance(pinned, MicroBatch)
    _same(b, pinned)
    before = {id(t) for t in b.tensors()}
    assert len(list(pinned.tensors())) == len(before) and not any(id(t) in before for t in pinned.tensors())


def test_to_moves_every_tensor_and_keeps_the_rest():
    b = _batch()
    moved = b.to(torch.device("cpu"), non_blocking=False)
    _same(b, moved)
    assert moved.shape == (2, b.labels.shape[1], b.ctx_positions.shape[1])
    wide = b.map_tensors(lambda t: t.double() if t.is_floating_point() else t)
    assert wide.loss_weight.dtype == torch.float64 and wide.labels.dtype == torch.long
    assert wide.loss_weight_sum == b.loss_weight_sum and wide.mask.keys() == b.mask.keys()
