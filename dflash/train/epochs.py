"""Each epoch's view of the store: the samples committed when the epoch starts (docs/DESIGN.md §5, §7).

A store may grow while a run trains from it (`precompute --append`, or `train --follow` next to a running
precompute).  Shards only ever append, so "what was committed at time t" is a count of samples per shard
(`Store.counts()`), and `open_store(path, upto=counts)` reads the store as it was then.  An epoch plans
over its snapshot; the checkpoint keeps the snapshot of the epoch in progress, so a resumed run finishes
that epoch over exactly the samples it planned, and later epochs cover the store as it has grown.

All processes of a run must plan over the same snapshot: each opens the store and they agree on the
per-shard minimum (every process's store holds at least that), by two all-reduces.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from dflash.config import TrainConfig
from dflash.errors import DataError, StoreError
from dflash.store import open_store
from dflash.store.manifest import MANIFEST, shard_name
from dflash.train.loader import PackedDataset
from dflash.train.plan import LoaderSpec


def _waited_too_long(cfg: TrainConfig, t0: float, what: str) -> None:
    if cfg.stream.follow_timeout and time.monotonic() - t0 > cfg.stream.follow_timeout:
        raise StoreError(f"--follow gave up after {cfg.stream.follow_timeout:.0f} s waiting for {what} (--follow-timeout). "
                         "Check that `dflash precompute` is running and writes to this --store.")


def wait_for_manifest(cfg: TrainConfig) -> None:
    """--follow: return once the store's manifest exists (precompute writes it before any shard starts)."""
    t0, told = time.monotonic(), False
    while not (Path(cfg.job.store) / MANIFEST).is_file():
        _waited_too_long(cfg, t0, f"store {cfg.job.store} to be created")
        if not told:
            print(f"train --follow: waiting for store {cfg.job.store} to be created by `dflash precompute` "
                  f"(looking every {cfg.stream.follow_poll:g} s).", flush=True)
            told = True
        time.sleep(cfg.stream.follow_poll)


def agree(counts: dict[str, int], world: int, device: torch.device) -> dict[str, int]:
    """The per-shard minimum of every process's counts (the snapshot all of them can read)."""
    if world <= 1:
        return counts
    dev = device if device.type == "cuda" else torch.device("cpu")
    n = torch.tensor([len(counts)], dtype=torch.int64, device=dev)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    v = torch.zeros(int(n.item()), dtype=torch.int64, device=dev)
    for i in range(len(counts)):
        v[i] = counts[shard_name(i)]
    dist.all_reduce(v, op=dist.ReduceOp.MIN)
    return {shard_name(i): int(c) for i, c in enumerate(v.tolist())}


class EpochSource:
    """The dataset of each epoch: `open(epoch, snapshot)` returns (PackedDataset, snapshot, seconds waited)."""

    def __init__(self, cfg: TrainConfig, spec: LoaderSpec, world: int, device: torch.device, rank: int = 0):
        self.cfg, self.spec, self.world, self.device, self.rank = cfg, spec, world, device, rank
        self.per_step = world * cfg.optim.grad_accum

    def open(self, epoch: int, snapshot: dict[str, int] | None = None) -> tuple[PackedDataset, dict[str, int], float]:
        cfg = self.cfg
        if snapshot is not None:  # resuming into this epoch: the samples it planned over
            return PackedDataset(open_store(cfg.job.store, upto=snapshot), self.spec), snapshot, 0.0
        t0, told = time.monotonic(), False
        while True:
            store = open_store(cfg.job.store, require_complete=not cfg.stream.follow)
            counts = agree(store.counts(), self.world, self.device)
            if counts != store.counts():
                store = open_store(cfg.job.store, upto=counts)
            dataset = PackedDataset(store, self.spec)
            micro = len(dataset.plan(epoch))
            if micro >= self.per_step:
                return dataset, counts, time.monotonic() - t0
            if not cfg.stream.follow:
                raise DataError(
                    f"an epoch of store {cfg.job.store} packs into {micro} micro-batches, fewer than one optimizer "
                    f"step needs ({self.world} processes x {cfg.optim.grad_accum} accumulation steps); use fewer "
                    "processes, less --grad-accum, a smaller --token-budget or a bigger store."
                )
            _waited_too_long(cfg, t0, f"enough committed samples in {cfg.job.store}")
            if self.rank == 0 and not told:
                print(f"train --follow: store {cfg.job.store} holds {len(store)} committed samples ({micro} micro-"
                      f"batches), fewer than one optimizer step needs ({self.per_step}); waiting for precompute "
                      f"to commit more (looking every {cfg.stream.follow_poll:g} s).", flush=True)
                told = True
            time.sleep(cfg.stream.follow_poll)


__all__ = ["EpochSource", "agree", "wait_for_manifest"]
