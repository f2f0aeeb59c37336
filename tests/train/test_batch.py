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


def _handles(b: MicroBatch) -> int:
    """Shared-memory handles the DataLoader's pickler sends for `b` (each costs the receiver a round trip)."""
    from multiprocessing import resource_sharer
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers the tensor reducers)

    cache = resource_sharer._resource_sharer._cache
    n0 = len(cache)
    ForkingPickler.dumps(b)
    return len(cache) - n0


def _small(b: MicroBatch) -> list[torch.Tensor]:
    return [b.ctx_positions, b.block_input_ids, b.block_positions, b.labels, b.loss_weight, b.block_pos_in_block,
            b.label_index, b.sample_ids, *b.mask.values()]


def test_small_tensors_cross_the_process_boundary_as_one_arena():
    b = _batch()
    assert b.arena is not None and all(b._in_arena(t) for t in _small(b)) and not b._in_arena(b.ctx_hidden)
    separate = b.map_tensors(lambda t: t.clone())
    assert separate.arena is None
    assert _handles(b) == 2 and _handles(separate) == len(_small(b)) + 1  # the arena and the context features
    back = pickle.loads(pickle.dumps(b))
    _same(b, back)
    assert all(back._in_arena(t) for t in _small(back))


def test_moving_a_batch_moves_its_arena_once_and_keeps_every_view(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **kw: self.clone())
    b = _batch()
    for moved in (b.pin_memory(), b.to(torch.device("cpu")), b.dequantised()):
        _same(dataclasses.replace(b, arena=moved.arena), moved)
        assert all(moved._in_arena(t) for t in _small(moved))
        assert [t.stride() for t in _small(moved)] == [t.stride() for t in _small(b)]
    assert b.pin_memory().arena.data_ptr() != b.arena.data_ptr()
