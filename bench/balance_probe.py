"""Two-GPU step balance measured on one GPU: each micro-batch of `dflash train`'s epochs timed alone, then
every candidate order's two-process steps replayed from those times.

    python bench/balance_probe.py [--tiny]      # $OUT/balance.json

Why: a step of W processes lasts as long as its slowest micro-batch (the gradient all-reduce waits for it),
so the order of an epoch's micro-batches decides how much of a 2-GPU step is spent waiting.  This probe
uses loader_bench's store and `dflash train`'s shapes (4096-token rows, 64 anchors, block 16, 5 layers,
`--rows-per-batch` from BENCH_TRAIN_ROWS, default 4), builds the epoch plan's micro-batches with the real
PackedDataset, and times each one's forward + backward (compiled drafter, fused Triton loss where CUDA
runs) with CUDA events, the median of BENCH_BALANCE_REPS (3) runs; the optimizer step is timed apart.

Orders replayed over the same micro-batches (the plan packs rows before it orders them):
  random     balance_group 1 (`--no-balance-steps`, and every run before balancing)
  landed     balance_group 2 (two processes, no accumulation: what `dflash train --gpus 0,1` plans)
  first      the first balancing (commit 65c9532): random groups of 16 sorted by cost
For each: one_gpu_s = sum of all micro-batch times + one optimizer step each; two_gpu_s = per step
max(rank 0, rank 1) + one optimizer step, the epoch's odd tail left out as RankSampler does.
`ideal_2_over_1` = one_gpu_s / two_gpu_s over the same micro-batches: the scaling with a free all-reduce
and host, i.e. what the order alone allows.  `balance_efficiency` = mean / max per step, summed.
"""

from __future__ import annotations

import argparse
import os
import time
from types import SimpleNamespace

import numpy as np
import torch

import common  # noqa: F401  (puts the repo root on sys.path)
from common import Results, elapsed, median, part_limit_s, sync, tiny_mode
from dflash.drafter import masks
from dflash.train import plan as P
from loader_bench import build_store, shapes
from step_workload import to_device
from train_step import Bench


def first_version_order(batches, ctx, blk, spec, seed: int, epoch: int) -> np.ndarray:
    """The first balancing (commit 65c9532): all micro-batches sorted by cost, cut in groups of 16,
    the groups in random order.  Reproduced here for the replay only (the package no longer has it)."""
    rng = np.random.default_rng([seed, epoch, 0x51])
    n = len(batches)
    shuffled = rng.permutation(n)
    keys = [P.batch_cost(batches[i], ctx, blk, spec) for i in shuffled]
    by_cost = shuffled[sorted(range(n), key=keys.__getitem__)]
    groups = [by_cost[i : i + 16] for i in range(0, n, 16)]
    return np.concatenate([groups[i] for i in rng.permutation(len(groups))]) if n else by_cost


def replay(order: list[int], t: dict, ctx_tokens: dict, opt_s: float, world: int = 2) -> dict:
    """One order's 1-process and `world`-process time over the same micro-batches (full steps only)."""
    n = len(order) // world * world
    steps = [order[i : i + world] for i in range(0, n, world)]
    one = sum(t[g] + opt_s for s in steps for g in s)
    two = sum(max(t[g] for g in s) + opt_s for s in steps)
    mean_over_max = sum(np.mean([t[g] for g in s]) for s in steps) / sum(max(t[g] for g in s) for s in steps)
    spread = [max(t[g] for g in s) / min(t[g] for g in s) for s in steps]
    return {"steps": len(steps), "ctx_tokens": int(sum(ctx_tokens[g] for s in steps for g in s)),
            "one_gpu_s": round(one, 3), "two_gpu_s": round(two, 3), "ideal_2_over_1": round(one / two, 4),
            "balance_efficiency": round(float(mean_over_max), 4),
            "step_spread_max_over_min_median": round(float(np.median(spread)), 3),
            "step_spread_max_over_min_max": round(float(np.max(spread)), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--epochs", type=int, default=int(os.environ.get("BENCH_BALANCE_EPOCHS", "3")))
    args = ap.parse_args()
    tiny = tiny_mode(args.tiny)
    limit = part_limit_s(200)
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    cuda = device.startswith("cuda")
    if tiny:
        torch.set_num_threads(1)
    reps = int(os.environ.get("BENCH_BALANCE_REPS", "1" if tiny else "3"))
    R = int(os.environ.get("BENCH_TRAIN_ROWS", "2" if tiny else "4"))
    sh = shapes(tiny)
    res = Results("balance", tiny=tiny, device=device, limit_s=limit, rows_per_batch=R, reps=reps, shapes=sh)

    from dflash.config import TrainConfig
    from dflash.store import open_store
    from dflash.train import loader as L

    with res.guard("store"):
        _, store_dir, mask_id = build_store(tiny, res)
    tc = TrainConfig()
    spec = L.LoaderSpec(block_size=sh["block_size"], num_anchors=sh["num_anchors"], token_budget=sh["token_budget"],
                        block_budget=sh["token_budget"], rows_per_batch=R, mask_token_id=mask_id, num_shapes=1,
                        seed=tc.job.seed)
    ds = L.PackedDataset(open_store(store_dir), spec)
    bargs = SimpleNamespace(layers=sh["num_layers"], block_size=sh["block_size"], lm_head_chunk=tc.objective.lm_head_chunk,
                            compile="auto", loss_kernel=tc.objective.loss_kernel if cuda else "compiled")
    t0 = time.perf_counter()
    bench = Bench(bargs, tiny, device)
    res.set("drafter", {"build_s": round(time.perf_counter() - t0, 1), "compiled": bench.compiled,
                        "loss_kernel": bargs.loss_kernel, "lm_head_chunk": bargs.lm_head_chunk})

    def fwd_bwd(m) -> None:
        bench.step(m, masks.to_block_mask, fused=True, host_syncs=False, optimizer_step=False)

    times: dict = {}  # (epoch, content key) -> seconds
    ctx_tokens: dict = {}
    orders: dict = {"random": [], "landed": [], "first": []}
    warm = False
    for epoch in range(args.epochs):
        plan = ds.plan(epoch)
        keyed = [(epoch, tuple(tuple(int(i) for i in r) for r in b)) for b in plan.batches]
        landed = P.plan_epoch(ds.lengths, ds.max_blocks, L.LoaderSpec(**{**spec.__dict__, "balance_group": 2}), epoch)
        landed_keys = [(epoch, tuple(tuple(int(i) for i in r) for r in b)) for b in landed.batches]
        if sorted(landed_keys) != sorted(keyed):
            raise SystemExit(f"epoch {epoch}: the balanced plan holds other micro-batches than the random one")
        ctx = np.minimum(ds.lengths, spec.s_shapes[-1])
        blk = ds.max_blocks * spec.block_size
        first = first_version_order(plan.batches, ctx, blk, spec, spec.seed, epoch)
        orders["random"] += keyed
        orders["landed"] += landed_keys
        orders["first"] += [keyed[g] for g in first]
        for g, rows in enumerate(plan.batches):
            if elapsed() > limit - 20:
                res.set("stopped_early", f"time: {elapsed():.0f}s of {limit:.0f}s, epoch {epoch}, micro-batch {g}")
                break
            b = ds.build(epoch, rows, g)
            m = to_device(b, device)
            if not warm:  # compile (one padded shape: num_shapes 1) and the loss kernel's first launch
                for _ in range(2):
                    fwd_bwd(m)
                sync(device)
                warm = True
                res.set("warmup_s", round(elapsed(), 1))
            runs = []
            for _ in range(reps):
                if cuda:
                    a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    sync(device)
                    a.record()
                    fwd_bwd(m)
                    z.record()
                    sync(device)
                    runs.append(a.elapsed_time(z) / 1e3)
                else:
                    t = time.perf_counter()
                    fwd_bwd(m)
                    runs.append(time.perf_counter() - t)
            times[keyed[g]] = median(runs)
            ctx_tokens[keyed[g]] = int(b.num_ctx_tokens)
            del m, b
        else:
            continue
        break
    opt = []
    for _ in range(3):
        sync(device)
        t = time.perf_counter()
        bench.opt.step()
        sync(device)
        opt.append(time.perf_counter() - t)
    bench.opt.zero_grad(set_to_none=True)
    opt_s = median(opt)
    vals = np.array(list(times.values()))
    res.set("micro_batches", {"timed": len(times), "per_epoch": [len(ds.plan(e)) for e in range(args.epochs)],
                              "fwd_bwd_ms_min": round(float(vals.min()) * 1e3, 2),
                              "fwd_bwd_ms_median": round(float(np.median(vals)) * 1e3, 2),
                              "fwd_bwd_ms_max": round(float(vals.max()) * 1e3, 2),
                              "optimizer_ms": round(opt_s * 1e3, 2)})
    for name, order in orders.items():
        # steps never cross an epoch (the sampler starts each epoch's plan afresh); only epochs timed in
        # full are replayed, so that every order covers the same micro-batches
        full = [e for e in range(args.epochs) if all(k in times for k in order if k[0] == e)]
        per_epoch = {e: [k for k in order if k[0] == e] for e in full}
        parts = [replay(seq, times, ctx_tokens, opt_s) for seq in per_epoch.values() if len(seq) >= 2]
        if not parts:
            continue
        one = sum(p["one_gpu_s"] for p in parts)
        two = sum(p["two_gpu_s"] for p in parts)
        res.set(name, {"epochs": parts, "ideal_2_over_1": round(one / two, 4),
                       "balance_efficiency": round(sum(p["balance_efficiency"] * p["two_gpu_s"] for p in parts)
                                                   / two, 4)})
    res.set("wall_s", round(elapsed(), 1))


if __name__ == "__main__":
    main()
