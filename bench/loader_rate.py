"""One loader worker's rate: micro-batches built in this process from a store of random hidden states.

    BENCH_SHAPE=smollm2-135m [BENCH_HIDDEN=fp8] python bench/loader_rate.py [--rows 8] [--anchors 64]
        [--epochs 3] [--target-labels]

Builds (once, in $BENCH_WORK) loader_bench.py's store of 200 chat-like samples at the shape's width, then
times `PackedDataset[(epoch, g)]` over whole epochs, checksums verified as training reads them: what one
DataLoader worker process does per micro-batch.  Prints the best epoch's milliseconds per micro-batch and
context tokens per second.
"""

from __future__ import annotations

import argparse
import time

import loader_bench as lb


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--target-labels", action="store_true", help="labels = the store's top-1 (reads top-k too)")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(1)  # as in a DataLoader worker (dflash.train.loader._worker_init)
    from dflash.store import open_store
    from dflash.train import loader as L

    _, store_path, mask = lb.build_store(False)
    spec = L.LoaderSpec(block_size=16, num_anchors=a.anchors, token_budget=4096, block_budget=4096,
                        rows_per_batch=a.rows, mask_token_id=mask, target_labels=a.target_labels)
    ds = L.PackedDataset(open_store(store_path, verify=True), spec)
    n = len(ds.plan(0).batches)
    ds[(0, 0)]  # opens the shard
    best, ctx = float("inf"), 0
    for _ in range(a.epochs):
        t, ctx = time.perf_counter(), 0
        for g in range(n):
            ctx += ds[(0, g)].num_ctx_tokens
        best = min(best, time.perf_counter() - t)
    print(f"{lb.hidden_dtype()} store: {best / n * 1000:.0f} ms per micro-batch of {a.rows} rows (best of {a.epochs} "
          f"epochs of {n}), "
          f"{ctx / best:,.0f} context tokens/s")


if __name__ == "__main__":
    main()
