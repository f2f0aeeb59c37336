"""What the training process pays to receive one micro-batch from a loader worker, the batch ready.

    BENCH_SHAPE=smollm2-135m BENCH_HIDDEN=fp8 python bench/batch_transfer.py [--rows 8] [--workers 4]
        [--batches 200] [--target-labels] [--rollout]

Builds (once, in $BENCH_WORK) loader_bench.py's store of 200 chat-like samples at the shape's width and
iterates the training DataLoader as `dflash train` makes it (forkserver workers, batch slots), pausing
before each take so that the workers are always ahead: what `next()` then costs is the training
process's own work per micro-batch (the queue, unpickling, a shared-memory handle per storage).  Prints
the median and mean milliseconds a take, and how many storages (shared-memory handles) a batch carries.
"""

from __future__ import annotations

import argparse
import statistics
import time

import loader_bench as lb
from common import dims


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--pause", type=float, default=0.05, help="seconds between takes (the workers catch up)")
    ap.add_argument("--target-labels", action="store_true", help="labels = the store's top-1 (reads top-k too)")
    ap.add_argument("--rollout", action="store_true", help="--labels rollout (implies --target-labels)")
    a = ap.parse_args()
    from dflash.store import open_store
    from dflash.train import loader as L
    from dflash.train.batch_slots import BatchSlots, default_num_slots

    _, store_path, mask = lb.build_store(False)
    spec = L.LoaderSpec(block_size=16, num_anchors=64, token_budget=4096, block_budget=4096, rows_per_batch=a.rows,
                        mask_token_id=mask, target_labels=a.target_labels or a.rollout, rollout_labels=a.rollout)
    ds = L.PackedDataset(open_store(store_path), spec)
    per_epoch = len(ds.plan(0).batches)
    epochs = -(-a.batches // per_epoch) + 1
    d = dims(False)
    slots = BatchSlots(default_num_slots(a.workers, 1), L.batch_bytes(spec, len(d["target_layer_ids"]) * d["hidden_size"]))
    sampler = L.RankSampler(ds, 0, 1, 1, 0, 0, per_epoch * epochs)
    loader = L.make_loader(ds, sampler, a.workers, slots=slots)
    it = iter(loader)
    takes, storages = [], set()
    for i in range(a.batches + 5):
        time.sleep(a.pause)
        t = time.perf_counter()
        b = next(it)
        dt = time.perf_counter() - t
        if i >= 5:  # the workers' start-up
            takes.append(dt)
            storages.add(len({t.untyped_storage().data_ptr() for t in b.tensors()}))
        slots.release(b.seq)
    it._shutdown_workers()
    print(f"{lb.hidden_dtype()} store, {a.rows} rows, {a.workers} workers: a take {statistics.median(takes) * 1e3:.2f} ms "
          f"median, {statistics.mean(takes) * 1e3:.2f} ms mean over {len(takes)}; storages a batch: {sorted(storages)}")


if __name__ == "__main__":
    main()
