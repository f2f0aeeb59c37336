"""Precompute throughput at Qwen3-8B shape: the target's forward alone against capture (hooks + chunked
top-k) and against capture + ShardWriter writes to local disk, bf16 and fp8 stores, through the writer
process (what `dflash precompute` runs: shared pinned slots, Python's GC frozen after set-up), and the writer
thread; the disk's raw write speed; then two processes (one per GPU, one shard each) at once.

    python bench/precompute_bench.py [--tiny] [--tokens 150000] [--token-budget N] [--disk-gb 2] [--passes ...]

The target is a random-init Qwen3ForCausalLM built directly on the GPU in bf16 (no 16 GB checkpoint to
save and reload), driven by `dflash.target_model.capture.Capture` and `dflash.precompute.shard`'s batch planner and write path
(`plan_batches`, `open_sink`, `_write_batch`: the functions `run_shard` calls) on synthetic token
sequences of 300-4096 tokens.  Results: $OUT/precompute.json; keys write_bf16 / write_fp8 (as precompute
runs), write_bf16_thread (writer thread, GC frozen), write_bf16_gc (writer thread, automatic GC: the
path before the writer process), capture_bg_thread / capture_bg_process
(capture beside a writer's load on a thread / in a process), disk (numpy write + fsync, GB/s),
write_profile (torch.profiler of a few batches of capture + writes: $OUT/precompute_write_profile.txt, a
Chrome trace and its GPU idle gaps).  --passes picks and orders nothing: it only selects (see ALL_PASSES).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

import common  # noqa: F401  (puts the repo root on sys.path)
from common import Results, dims, elapsed, part_limit_s, sync, tiny_mode, work_dir
from dflash import hostgc
from precompute_workload import (
    TOPK,
    background_writer,
    batches_of,
    build_target,
    capture_and_write,
    capture_before_class,
    dir_bytes,
    make_store,
    sequences,
)

ALL_PASSES = ("forward forward_full capture capture_before write_bf16 write_bf16_before write_fp8 write_profile "
              "capture_bg_thread capture_bg_process write_bf16_thread write_bf16_gc disk two_gpus two_gpus_fp8 two_gpus_capture io2")


def profile_write(res: Results, capture, batches, tiny: bool, device: str, budget: int, n: int = 8) -> None:
    """torch.profiler (CPU + CUDA) over `n` batches of capture + bf16 writes as precompute runs them: where the main
    thread is while the GPU idles (the gap between capture and capture + writes).  Writes
    $OUT/precompute_write_profile.txt (by self CPU time and by self device time) and a Chrome trace
    $OUT/precompute_write_trace.json; records the GPU's busy fraction of the profiled wall time."""
    from torch.profiler import ProfilerActivity, profile

    from common import out_dir

    store = work_dir() / "pc_profile"
    make_store(store, tiny, "bf16", 1)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    t = time.perf_counter()
    with profile(activities=acts) as prof:
        capture_and_write(capture, batches[:n], store, 0, tiny, device, "bf16", "process", budget)
    wall = time.perf_counter() - t
    avg = prof.key_averages()
    tables = []
    for key in ("self_cpu_time_total", "self_device_time_total"):
        with contextlib.suppress(Exception):  # device column names vary across torch versions
            tables.append(f"== sorted by {key}\n" + avg.table(sort_by=key, row_limit=40, max_name_column_width=90))
    (out_dir() / "precompute_write_profile.txt").write_text("\n\n".join(tables))
    prof.export_chrome_trace(str(out_dir() / "precompute_write_trace.json"))
    busy_us = sum(e.self_device_time_total for e in avg if getattr(e, "device_type", None) is not None
                  and str(e.device_type).endswith("CUDA"))
    import trace_gaps

    gaps = None
    trace = out_dir() / "precompute_write_trace.json"
    with contextlib.suppress(Exception):
        gaps = trace_gaps.summarize_file(trace)
    with contextlib.suppress(Exception), open(trace, "rb") as f, gzip.open(f"{trace}.gz", "wb") as z:
        shutil.copyfileobj(f, z)  # files come back from the device up to 16 MiB
    trace.unlink(missing_ok=True)
    res.set("write_profile", {"batches": n, "wall_s_profiled": round(wall, 2),
                              "gpu_busy_frac": round(busy_us / 1e6 / wall, 3) if busy_us else None,
                              "trace_gaps": gaps,
                              "files": ["precompute_write_profile.txt", "precompute_write_trace.json.gz"]})
    shutil.rmtree(store, ignore_errors=True)


def capture_beside_writer(res: Results, rates: dict, capture_pass, capture, tiny: bool, how: str) -> None:
    """The capture pass again while a ShardWriter appends synthetic data at the capture's own rate, on a
    thread of this process (the write pipeline's arrangement) or in a process of its own."""
    import multiprocessing as mp
    import threading

    store = str(work_dir() / f"pc_bg_{how}")
    make_store(Path(store), tiny, "bf16", 1)
    ctx = mp.get_context("spawn")
    stop, ready, report = (threading.Event(), threading.Event(), __import__("queue").Queue()) if how == "thread" else (
        ctx.Event(), ctx.Event(), ctx.Queue())
    args = (store, tiny, rates["capture"], stop, ready, report)
    worker = (threading.Thread(target=background_writer, args=args, daemon=True) if how == "thread"
              else ctx.Process(target=background_writer, args=args, daemon=True))
    worker.start()
    ready.wait(120)
    key = f"capture_bg_{how}"
    try:
        capture_pass(key, capture, f"capture while a writer {how} appends synthetic bf16 samples at the capture's rate")
    finally:
        stop.set()
        worker.join(60)
    bg = report.get(timeout=30)
    res.data[key].update(background_writer=bg, writer_kept_up=round(bg["tokens_per_s"] / rates["capture"], 3))
    res.save()
    shutil.rmtree(store, ignore_errors=True)


def disk_write(path: Path, nbytes: int) -> dict:
    """The disk's ceiling: numpy writes `nbytes` (256 MB at a time) to one file, then fsync; GB/s."""
    block = np.random.default_rng(0).integers(0, 256, min(nbytes, 256 * 2**20), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    with open(path, "wb") as f:
        done = 0
        while done < nbytes:
            n = min(len(block), nbytes - done)
            f.write(memoryview(block[:n]))
            done += n
        f.flush()
        t_write = time.perf_counter() - t
        os.fsync(f.fileno())
    dt = time.perf_counter() - t
    path.unlink()
    return {"bytes": nbytes, "write_s": round(t_write, 2), "fsync_s": round(dt - t_write, 2), "s": round(dt, 2),
            "gb_per_s": round(nbytes / dt / 1e9, 3), "gb_per_s_before_fsync": round(nbytes / t_write / 1e9, 3),
            "what": "numpy buffer -> file.write in 256 MB blocks, then fsync (page cache + disk)"}


def _shard_proc(rank: int, tiny: bool, tokens: int, store: str, barrier, queue, hidden_dtype: str = "bf16",
                write: bool = True) -> None:
    """One of the two simultaneous shard processes: its own GPU, its own shard, half of the samples; with
    write=False it captures only (nothing copied out or written), to tell the writes' share of any slowdown."""
    try:
        from dflash.target_model.capture import Capture

        device = f"cuda:{rank}" if torch.cuda.is_available() else "cpu"
        if device == "cpu":
            torch.set_num_threads(1)
        else:
            torch.cuda.set_device(device)
        d = dims(tiny)
        t = time.perf_counter()
        model = build_target(tiny, device)
        capture = Capture(model, d["target_layer_ids"], topk=TOPK, lm_head_chunk=4096)
        samples = sequences(tiny, tokens, d["vocab_size"])
        mine = [s for i, s in enumerate(samples) if i % 2 == rank]
        batches = batches_of(mine, 1024 if tiny else 16384)
        # Warm-up as the one-GPU passes get it (main(): the compiled top-k meets two chunk lengths, then a
        # forward pass over every batch: allocator, cuBLAS and lazily loaded kernels for each shape), so
        # that the comparison is of steady rates; a real shard runs for hours.
        capture(batches[0][1].to(device), batches[0][2])  # (lengths stay on the host)
        capture(batches[-1][1].to(device), batches[-1][2])
        with torch.inference_mode():
            for _, ids, _ in batches:
                capture.decoder(input_ids=ids.to(device), use_cache=False)
        sync(device)
        init_s = time.perf_counter() - t
        hostgc.freeze()  # as run_shard does after its first batch (the one-GPU write passes do the same)
        barrier.wait()
        t0 = time.time()
        pstats = {}
        ntok = sum(len(s.input_ids) for s in mine)
        with hostgc.GcTimer() as gct:
            if write:
                dt = capture_and_write(capture, batches, Path(store), rank, tiny, device, hidden_dtype, stats=pstats)
            else:
                t = time.perf_counter()
                for _, ids, lengths in batches:
                    capture(ids.to(device), lengths)
                sync(device)
                dt = time.perf_counter() - t
        if pstats.get("drain_s") is not None:
            pstats["tokens_per_s_without_drain"] = ntok / max(dt - pstats["drain_s"], 1e-9)
        queue.put({"rank": rank, "tokens": ntok, "t0": t0, "t1": time.time(), "wall_s": dt, "init_s": init_s,
                   "device": device, "tokens_per_s": ntok / dt, "gc_s": gct.total_s, **pstats})
    except Exception as e:  # noqa: BLE001
        import traceback

        queue.put({"rank": rank, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]})


def two_processes(res: Results, tiny: bool, tokens: int, one_gpu_rate: float | None, timeout: float,
                  hidden_dtype: str = "bf16", key: str = "two_gpus", write: bool = True,
                  one_gpu_rate_without_drain: float | None = None) -> None:
    import torch.multiprocessing as mp

    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        res.set(key, {"skipped": f"{torch.cuda.device_count()} GPU visible"})
        return
    store = work_dir() / "pc_two"
    make_store(store, tiny, hidden_dtype, 2)
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.SimpleQueue()
    procs = [ctx.Process(target=_shard_proc, args=(r, tiny, tokens, str(store), barrier, queue, hidden_dtype, write))
             for r in range(2)]
    for p in procs:
        p.start()
    out, deadline = [], time.time() + timeout
    while len(out) < 2 and time.time() < deadline:
        if not queue.empty():
            out.append(queue.get())
        elif all(p.exitcode is not None for p in procs) and queue.empty():
            break
        else:
            time.sleep(0.1)
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    errors = [o for o in out if "error" in o]
    if errors or len(out) < 2:
        res.set(key, {"error": errors[0]["error"] if errors else f"only {len(out)} of 2 processes reported "
                             f"within {timeout:.0f}s", "reports": out})
    else:
        total = sum(o["tokens"] for o in out)
        span = max(o["t1"] for o in out) - min(o["t0"] for o in out)
        rate = total / span
        # The one-GPU passes time capture + writes only (the writer process starts, ~5 s, before that span);
        # the same span here: from the first process's timed start (t1 - its wall_s) to the last end.
        timed = max(o["t1"] for o in out) - min(o["t1"] - o["wall_s"] for o in out)
        # Each process's own rate (its tokens over its own timed span) against one GPU alone: what the
        # second process costs the first, apart from start-up skew between them.
        own = sum(o["tokens_per_s"] for o in out)
        extra = {"sum_of_process_rates": round(own),
                 "scaling_sum_of_process_rates": round(own / one_gpu_rate, 3) if one_gpu_rate else None}
        if write and one_gpu_rate_without_drain and all("tokens_per_s_without_drain" in o for o in out):
            nd = sum(o["tokens_per_s_without_drain"] for o in out)
            extra.update(sum_of_process_rates_without_drain=round(nd),
                         scaling_without_drain=round(nd / one_gpu_rate_without_drain, 3))
        res.set(key, {
            **extra, "writes": write,
            "hidden_dtype": hidden_dtype, "tokens": total, "wall_s": round(span, 2), "tokens_per_s": round(rate),
            "per_process": [{k: (round(v, 2) if isinstance(v, float) else v) for k, v in o.items() if k not in ("t0", "t1")}
                            for o in sorted(out, key=lambda o: o["rank"])],
            "one_gpu_tokens_per_s": round(one_gpu_rate) if one_gpu_rate else None,
            "scaling_vs_1gpu": round(rate / one_gpu_rate, 3) if one_gpu_rate else None,
            "timed_wall_s": round(timed, 2), "tokens_per_s_timed": round(total / timed),
            "scaling_vs_1gpu_timed": round(total / timed / one_gpu_rate, 3) if one_gpu_rate else None,
            "note": "each process writes its own shard of one store; total = all tokens / (last end - first start), "
                    "which includes each shard's writer-process start-up; *_timed: the span the one-GPU passes "
                    "time (capture + writes), first timed start to last end",
        })
    shutil.rmtree(store, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per measurement (default 300000; tiny 3000)")
    ap.add_argument("--token-budget", type=int, default=None, help="tokens per forward batch (precompute's default)")
    ap.add_argument("--disk-gb", type=float, default=None, help="GB for the raw disk write (default 2; tiny 0.25)")
    ap.add_argument("--passes", default=os.environ.get("BENCH_PC_PASSES", ALL_PASSES),
                    help=f"which measurements, in this order of priority (default: {ALL_PASSES})")
    ap.add_argument("--shape", default=None, help="target shape: qwen3-8b (default) or qwen3-32b")
    ap.add_argument("--name", default="precompute", help="results file $OUT/<name>.json")
    args = ap.parse_args()
    passes = set(args.passes.split())
    if args.shape:
        os.environ["BENCH_SHAPE"] = args.shape  # dims() reads it, here and in the shard processes
    tiny = tiny_mode(args.tiny)
    limit = part_limit_s(130)
    from dflash.config import PrecomputeConfig
    from dflash.target_model.capture import Capture

    tokens = args.tokens or (3000 if tiny else 300_000)
    budget = args.token_budget or (1024 if tiny else PrecomputeConfig().token_budget)
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)
    d = dims(tiny)
    res = Results(args.name, shape=os.environ.get("BENCH_SHAPE") or "qwen3-8b", tiny=tiny, device=device, tokens_target=tokens, token_budget=budget, topk=TOPK,
                  target_layer_ids=d["target_layer_ids"], limit_s=limit)
    t = time.perf_counter()
    model = build_target(tiny, device)
    sync(device)
    n_params = sum(p.numel() for p in model.parameters())
    res.set("target_build", {"s": round(time.perf_counter() - t, 1), "params": n_params,
                             "gpu_mem_gib": round(torch.cuda.memory_allocated() / 2**30, 2) if device != "cpu" else None})
    capture = Capture(model, d["target_layer_ids"], topk=TOPK, lm_head_chunk=4096)
    capture_before = capture_before_class()(model, d["target_layer_ids"], topk=TOPK, lm_head_chunk=4096)
    samples = sequences(tiny, tokens, d["vocab_size"])
    batches = batches_of(samples, budget)
    ntok = sum(len(s.input_ids) for s in samples)
    padded = sum(ids.numel() for _, ids, _ in batches)
    res.set("workload", {"samples": len(samples), "tokens": ntok, "padded_tokens": padded, "batches": len(batches),
                         "length_range": [min(len(s.input_ids) for s in samples), max(len(s.input_ids) for s in samples)]})

    # warm-up: kernels, cuBLAS handles, allocator
    with torch.inference_mode():
        capture.decoder(input_ids=batches[0][1].to(device), use_cache=False)
    capture(batches[0][1].to(device), batches[0][2])
    capture(batches[-1][1].to(device), batches[-1][2])  # the compiled top-k meets a second chunk length
    if "capture_before" in passes or "write_bf16_before" in passes:
        capture_before(batches[0][1].to(device), batches[0][2])
    sync(device)

    rates = {}

    def best_of_two(module) -> tuple[float, list[float]]:
        """Seconds for one pass of `module` over every batch, best of two (the first pass also meets
        every batch shape for the first time)."""
        times = []
        for _ in range(2):
            sync(device)
            t = time.perf_counter()
            with torch.inference_mode():
                for _, ids, _ in batches:
                    module(input_ids=ids.to(device), use_cache=False)
            sync(device)
            times.append(time.perf_counter() - t)
        return min(times), [round(x, 2) for x in times]

    def ratios(key: str) -> dict:
        return {f"ratio_vs_{ref}": round(rates[key] / rates[ref], 3) for ref in ("forward", "forward_full", "capture")
                if ref in rates and ref != key}

    if "forward" in passes:
        with res.guard("forward"):
            dt, times = best_of_two(capture.decoder)
            rates["forward"] = ntok / dt
            res.set("forward", {"what": "decoder forward only (no hooks, no lm_head, no top-k), best of 2 passes",
                                "s": round(dt, 2), "passes_s": times, "tokens_per_s": round(ntok / dt),
                                "tflops_matmul_est": round(2 * (n_params - 2 * d["vocab_size"] * d["hidden_size"]) * padded / dt / 1e12, 1)})

    if "forward_full" in passes:
        with res.guard("forward_full"):
            # The model's whole forward as a capture server runs it: decoder + lm_head logits at every
            # position (transformers' CausalLM forward), no hooks, nothing copied out.
            dt, times = best_of_two(capture.model)
            rates["forward_full"] = ntok / dt
            res.set("forward_full", {"what": "model(input_ids): decoder + lm_head logits at every position, best of 2",
                                     "s": round(dt, 2), "passes_s": times, "tokens_per_s": round(ntok / dt), **ratios("forward_full")})

    def capture_pass(key: str, cap, what: str) -> None:
        with res.guard(key):
            sync(device)
            t = time.perf_counter()
            for _, ids, lengths in batches:
                cap(ids.to(device), lengths)  # lengths on the host, as precompute passes them
            sync(device)
            dt = time.perf_counter() - t
            rates[key] = ntok / dt
            res.set(key, {"what": what, "s": round(dt, 2), "tokens_per_s": round(ntok / dt), **ratios(key)})

    if "capture" in passes:
        capture_pass("capture", capture, "forward + hooks on the chosen layers + chunked lm_head top-k (no copy out): "
                     "top-k on the bf16 logits, fused fp32 logsumexp (compiled), real positions from host lengths")
    if "capture_before" in passes:
        capture_pass("capture_before", capture_before, "the same with the first top-k: fp32 log_softmax per chunk "
                     "then top-k, real positions by boolean indexing on the device (host syncs)")

    def write_pass(hd: str, mode: str = "process", frozen: bool = True, io_threads: int = 4, before: bool = False,
                   key: str | None = None) -> None:
        """Capture + writes as precompute runs them (mode process, GC frozen after set-up) or a variant."""
        key = key or (f"write_{hd}" + ("" if mode == "process" else f"_{mode}") + ("" if io_threads == 4 else f"_io{io_threads}")
                      + ("_before" if before else ""))
        if elapsed() > 0.8 * limit:
            res.set(key, {"skipped": f"time: {elapsed():.0f}s of {limit:.0f}s"})
            return
        with res.guard(key):
            store = work_dir() / f"pc_{hd}"
            make_store(store, tiny, hd, 1)
            pstats = {}
            cap = capture_before if before else capture
            # frozen: what run_shard does after its first batch (dflash.hostgc.freeze): no GC walks the model
            freeze_s = hostgc.freeze() if frozen else None
            try:
                with hostgc.GcTimer() as gct:
                    dt = capture_and_write(cap, batches, store, 0, tiny, device, hd, mode, budget, io_threads, pstats)
            finally:
                if frozen:
                    hostgc.unfreeze()
            pstats.update(gc_s=round(gct.total_s, 3), gc_collections=gct.collections, gc_frozen=frozen,
                          freeze_s=round(freeze_s, 3) if frozen else None)
            nbytes = dir_bytes(store)
            from dflash.store import open_store

            committed = len(open_store(store))
            rates[key] = ntok / dt
            how = {"process": "writer process, 3 shared pinned slots (what precompute runs)",
                   "thread": "writer thread, 3 pinned host buffers (the first precompute)"}[mode]
            entry = {"what": f"capture + copy out + ShardWriter append/commit/finalize ({hd} hidden, top-{TOPK}); {how}"
                             + ("; GC frozen after set-up" if frozen else "; Python's automatic GC")
                             + ("; the first top-k (capture_before)" if before else ""),
                     "mode": mode, "s": round(dt, 2), "tokens_per_s": round(ntok / dt), **ratios(key),
                     "samples_committed": committed, "store_bytes": nbytes, "bytes_per_token": round(nbytes / ntok, 1),
                     "write_gb_per_s": round(nbytes / dt / 1e9, 3), "io_threads": io_threads, **pstats}
            if pstats.get("drain_s") is not None:  # the rate a long run approaches: the drain is paid once per shard
                entry["tokens_per_s_without_drain"] = round(ntok / max(dt - pstats["drain_s"], 1e-9))
                for ref in ("forward", "capture"):
                    if ref in rates:
                        entry[f"ratio_without_drain_vs_{ref}"] = round(entry["tokens_per_s_without_drain"] / rates[ref], 3)
            res.set(key, entry)
            shutil.rmtree(store, ignore_errors=True)

    if passes & {"write_bf16", "write_bf16_before", "write_fp8", "write_profile", "io2"}:
        with res.guard("write_warmup"):  # first-use costs (imports, codecs, thread start) off the timed passes
            for mode in ("process", "thread"):
                store = work_dir() / "pc_warmup"
                make_store(store, tiny, "bf16", 1)
                capture_and_write(capture, batches[:1], store, 0, tiny, device, "bf16", mode, budget)
                shutil.rmtree(store, ignore_errors=True)
    if "write_bf16" in passes:
        write_pass("bf16")
    if "write_bf16_before" in passes:
        write_pass("bf16", before=True)
    if "write_fp8" in passes:
        write_pass("fp8")
    if "write_bf16_thread" in passes:
        write_pass("bf16", mode="thread")
    if "write_bf16_gc" in passes:  # the path before the writer process: writer thread, automatic GC
        write_pass("bf16", mode="thread", frozen=False, key="write_bf16_gc")
    if "write_profile" in passes:
        with res.guard("write_profile"):
            profile_write(res, capture, batches, tiny, device, budget)
    for how in ("thread", "process"):  # capture beside the store's write load, on a thread or in a process
        if f"capture_bg_{how}" in passes and "capture" in rates:
            with res.guard(f"capture_bg_{how}"):
                capture_beside_writer(res, rates, capture_pass, capture, tiny, how)
    if "disk" in passes:
        with res.guard("disk"):
            gb = args.disk_gb if args.disk_gb is not None else (0.25 if tiny else 2.0)
            res.set("disk", disk_write(work_dir() / "disk_probe.bin", int(gb * 1e9)))
    # Two shard processes next (this process's model stays on GPU 0 beside theirs: 2 x 16 GB fits).
    for hd in ("bf16", "fp8", "capture"):
        key = "two_gpus" if hd == "bf16" else f"two_gpus_{hd}"
        if key not in passes:
            continue
        left = limit - elapsed() - 10
        if left < 40:
            res.set(key, {"skipped": f"time: {elapsed():.0f}s of {limit:.0f}s"})
            continue
        with res.guard(key):
            if hd == "capture":  # both capture only: against the one-GPU capture pass
                two_processes(res, tiny, tokens, rates.get("capture"), timeout=left, key=key, write=False)
            else:
                solo = res.data.get(f"write_{hd}") if isinstance(res.data.get(f"write_{hd}"), dict) else {}
                two_processes(res, tiny, tokens, rates.get(f"write_{hd}"), timeout=left, hidden_dtype=hd, key=key,
                              one_gpu_rate_without_drain=solo.get("tokens_per_s_without_drain"))
    if "io2" in passes:
        write_pass("bf16", io_threads=2)
    res.set("wall_s", round(elapsed(), 1))

if __name__ == "__main__":
    main()
