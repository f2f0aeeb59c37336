"""Training-side data path at Qwen3-8B width, and `dflash train` on 1 GPU against 2 GPUs.

    python bench/loader_bench.py --part loader  [--tiny]   # build a store, time the real DataLoader
    python bench/loader_bench.py --part scaling [--tiny]   # dflash train --gpus 0, then --gpus 0,1
    python bench/loader_bench.py --part host --tiny        # the host's ms and top costs per step (bench/host_profile.py)

`--part loader` writes a fake target directory (config.json of Qwen3-8B, a chat-templated tokenizer, a
model.safetensors holding only the embedding and lm_head, random) and a store of ~200 samples of random
bf16 hidden states (5 x 4096 wide) with ShardWriter, then iterates the real training DataLoader
(`loader.PackedDataset` + `RankSampler` + `make_loader`: forkserver workers reading the store, packing,
anchors, labels, mask metadata) with 2, 4 and 8 workers.  Results: $OUT/loader.json.

`--part scaling` runs the real CLI (`python -m dflash.cli train`, compile on) on that store and target for a
fixed number of steps with one GPU, then two, and reads the per-step records of metrics.jsonl.  The run is
stopped once its last step is logged (the final checkpoint, 12 GB of fp32 weights and Adam state at this
size, is not part of the throughput).  Results: $OUT/train_scaling.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import common  # noqa: F401  (puts the repo root on sys.path)
from common import ROOT, Results, dims, elapsed, make_fake_target, median, out_dir, part_limit_s, tiny_mode, work_dir
from dflash.jsonl import jsonl_lines
from dflash.train.trainer import HOST_PHASES

TOPK = 8


def shapes(tiny: bool) -> dict:
    """The training shapes both parts use (the same as bench/train_step.py's main config)."""
    if tiny:
        return dict(token_budget=512, num_anchors=8, block_size=16, num_layers=2, samples=60, lengths=(20, 200))
    return dict(token_budget=4096, num_anchors=64, block_size=16, num_layers=5, samples=200, lengths=(300, 4096))


def hidden_dtype() -> str:
    """The store's hidden dtype: BENCH_HIDDEN=fp8 for the fp8 stores of large data (bf16 by default).  A
    work dir holds one store: give each dtype its own BENCH_WORK."""
    return os.environ.get("BENCH_HIDDEN", "bf16")


def build_store(tiny: bool, res: Results | None = None) -> tuple[Path, Path, int]:
    """(target dir, store dir, mask token id), built once per work dir."""
    from dflash.store import ShardWriter, create_or_check_manifest
    from dflash.target_model.files import target_identity, tokenizer_hash

    w = work_dir()
    tdir, store, info = w / "target", w / "store", w / "store_info.json"
    if info.is_file():
        i = json.loads(info.read_text())
        return tdir, store, i["mask_token_id"]
    t = time.perf_counter()
    tdir, n_tok = make_fake_target(tdir, tiny)
    t_target = time.perf_counter() - t
    d, sh = dims(tiny), shapes(tiny)
    L, H = len(d["target_layer_ids"]), d["hidden_size"]
    create_or_check_manifest(store, {
        "target": target_identity(tdir), "tokenizer_hash": tokenizer_hash(tdir), "dataset_fingerprint": "bench",
        "target_layer_ids": d["target_layer_ids"], "hidden_dtype": hidden_dtype(), "topk": TOPK,
        "max_length": sh["lengths"][1], "num_shards": 1}, overwrite=True)
    rng = np.random.default_rng(0)
    lo, hi = sh["lengths"]
    # Chat-like lengths: most around a thousand tokens, a tail up to the row budget.
    lengths = np.clip(rng.lognormal(np.log(lo * 3), 0.6, sh["samples"]), lo, hi).astype(int)
    pool = torch.randn(2 * hi, L * H).to(torch.bfloat16)
    t = time.perf_counter()
    with ShardWriter(store, 0, hidden_width=L * H, num_layers=L, hidden_dtype=hidden_dtype(), topk=TOPK,
                     durable=False) as wr:
        for sid, n in enumerate(lengths):
            n = int(n)
            o = int(rng.integers(0, len(pool) - n + 1))
            mask = np.ones(n, np.uint8)
            mask[: n // 7] = 0  # the prompt
            wr.append(sid, sid, rng.integers(0, n_tok, n), mask, pool[o : o + n],
                      torch.from_numpy(rng.integers(0, n_tok, (n, TOPK))), -torch.rand(n, TOPK))
        wr.finalize({"bench": True})
    t_store = time.perf_counter() - t
    total = int(lengths.sum())
    info.write_text(json.dumps({"mask_token_id": n_tok, "tokens": total}))
    if res is not None:
        res.set("store", {"samples": len(lengths), "tokens": total, "mean_length": round(float(lengths.mean()), 1),
                          "hidden_width": L * H, "hidden_gb": round(total * L * H * 2 / 1e9, 2),
                          "write_s": round(t_store, 1), "write_gb_per_s": round(total * L * H * 2 / 1e9 / t_store, 3),
                          "fake_target_s": round(t_target, 1), "mask_token_id": n_tok})
    return tdir, store, n_tok


def drop_page_cache() -> str | None:
    """Empty the page cache (root only) so the next read comes from the disk; None when that worked."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return None
    except OSError as e:
        return f"{type(e).__name__}: {e}"


def iterate(store_path: Path, mask_id: int, tiny: bool, workers: int, max_batches: int, cap_s: float,
            verify: bool = True) -> dict:
    """Pull micro-batches from the real training DataLoader; rates exclude the workers' start-up."""
    from dflash.store import open_store
    from dflash.train import loader as L

    sh = shapes(tiny)
    spec = L.LoaderSpec(block_size=sh["block_size"], num_anchors=sh["num_anchors"], token_budget=sh["token_budget"],
                        block_budget=sh["token_budget"], rows_per_batch=1, mask_token_id=mask_id)
    store = open_store(store_path, verify=verify)  # verify: each sample's checksums, as training reads them
    ds = L.PackedDataset(store, spec)
    sampler = L.RankSampler(ds, rank=0, world=1, accum=1, start_epoch=0, start_batch=0, steps=max_batches)
    t0 = time.perf_counter()
    dl = L.make_loader(ds, sampler, workers, pin_memory=torch.cuda.is_available())
    it = iter(dl)
    next(it)
    t_first = time.perf_counter()
    n = ctx = blk = nbytes = 0
    for b in it:
        n += 1
        ctx += b.num_ctx_tokens
        blk += b.num_block_tokens
        nbytes += b.ctx_hidden.numel() * b.ctx_hidden.element_size()
        if time.perf_counter() - t_first > cap_s:
            break
    dt = time.perf_counter() - t_first
    del it, dl
    width = store.hidden_size * store.num_layers
    return {"workers": workers, "batches": n, "s": round(dt, 2), "startup_s": round(t_first - t0, 2),
            "batches_per_s": round(n / dt, 2), "ctx_tokens_per_s": round(ctx / dt),
            "block_tokens_per_s": round(blk / dt),
            "gb_per_s": round(ctx * width * 2 / dt / 1e9, 3),
            "padded_gb_per_s": round(nbytes / dt / 1e9, 3),
            "epoch_micro_batches": len(ds.plan(0)), "pin_memory": torch.cuda.is_available()}


def part_loader(tiny: bool, limit: float) -> None:
    res = Results("loader", tiny=tiny, limit_s=limit, shapes=shapes(tiny))
    try:
        _, store, mask_id = build_store(tiny, res)
    except Exception:
        with res.guard("store"):
            raise
        return
    out = {}
    counts = (1, 2) if tiny else (2, 4, 8)
    cap = 3.0 if tiny else 8.0
    # BENCH_LOADER_VERIFY_AB=1: each worker count with and without the per-sample checksums, alternating
    ab = os.environ.get("BENCH_LOADER_VERIFY_AB") == "1"
    for w in counts:
        for verify in ((True, False, True, False) if ab else (True,)):
            key = f"workers_{w}" + (("_verify_on" if verify else "_verify_off") if ab else "")
            if elapsed() + cap + 15 > limit:
                out[key] = {"skipped": f"time: {elapsed():.0f}s of {limit:.0f}s"}
                continue
            with res.guard(key):
                r = iterate(store, mask_id, tiny, w, 10_000, cap, verify=verify)
                out[key] = [*out[key], r] if isinstance(out.get(key), list) else ([r] if ab else r)
                res.set("loader", out)
    res.set("loader", out)
    if not tiny and elapsed() + cap + 20 < limit:
        with res.guard("cold_cache"):
            why = drop_page_cache()
            if why:
                res.set("cold_cache", {"skipped": f"cannot drop the page cache ({why})"})
            else:
                r = iterate(store, mask_id, tiny, counts[-1], 10_000, cap)
                r["note"] = "page cache dropped first: hidden states read from the disk"
                res.set("cold_cache", r)
    res.set("note", "warm runs read a store that was just written (page cache); per training process, one "
                    "row of token_budget context tokens per micro-batch; compare ctx_tokens_per_s with "
                    "train_step.flex.ctx_tokens_per_s")
    res.set("wall_s", round(elapsed(), 1))


# ------------------------------------------------------------------------------------------ scaling


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc), to stop a run whose workers may sit in other groups."""
    children: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(p.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _stop(proc: subprocess.Popen) -> None:
    """SIGKILL the run this bench started: its process and everything below it (by pid)."""
    for pid in [proc.pid, *_descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    recs = []
    for line in jsonl_lines(path.read_text()):
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return recs


def _profile_steps() -> int:
    return int(os.environ.get("BENCH_TRAIN_PROFILE", "0"))


def _settings(spec: str | None) -> dict:
    """'gc_every=0,ddp_overlap=false' -> {"gc_every": 0, "ddp_overlap": False} (values are JSON)."""
    out = {}
    for part in (spec or "").split(","):
        if part.strip():
            key, _, val = part.partition("=")
            out[key.strip()] = json.loads(val.strip())
    return out


def train_run(tiny: bool, gpus: str, steps: int, skip: int, timeout: float, tag: str, workers: int,
              settings: dict | None = None) -> dict:
    tdir, store, _ = build_store(tiny)
    sh = shapes(tiny)
    w = work_dir()
    run = w / f"run_{tag}"
    params = w / f"params_{tag}.yaml"
    params.write_text("train:\n" + "".join(f"  {k}: {json.dumps(v)}\n" for k, v in {  # JSON values: YAML reads a bare on/off as a bool
        "num_layers": sh["num_layers"], "block_size": sh["block_size"], "token_budget": sh["token_budget"],
        "num_anchors": sh["num_anchors"], "num_shapes": 1, "num_workers": workers,
        "compile": "off" if tiny else "on", "warmup_steps": 5, "steps": steps, "save_every": 0,
        "rows_per_batch": int(os.environ.get("BENCH_TRAIN_ROWS", "1")),
        # BENCH_TRAIN_PROFILE=N: N steps profiled in every process, the last ones before the steady steps
        # (so the profiler's overhead stays out of the rates), after compilation; tables to $OUT
        "profile_steps": _profile_steps(), "profile_start": max(2, skip - _profile_steps()),
        "keep_checkpoints": 1, **(settings or {})}.items()))
    cmd = [sys.executable, "-m", "dflash.cli", "train", "--config", str(params), "--store", str(store),
           "--target", str(tdir), "--out", str(run), "--gpus", gpus, "--overwrite"]
    log = w / f"train_{tag}.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    with open(log, "w") as f:
        # Same process group as this bench, so that a timeout of the bench (bench/run.py --timeout) stops the run along with it.
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=str(w), env=env)
    first_step_s, stopped, timed_out = None, False, False
    spy, spy_out = None, out_dir() / f"pyspy_{tag}.txt"
    spy_tags = (os.environ.get("BENCH_TRAIN_PYSPY") or "").split(",")
    stop_early = not tiny or os.environ.get("BENCH_STOP_EARLY") == "1"  # tiny runs finish (checks the whole flow)
    metrics = run / "metrics.jsonl"
    while True:
        recs = _records(metrics)
        if recs and first_step_s is None:
            first_step_s = time.perf_counter() - t0
        if tag in spy_tags and spy is None and recs and recs[-1].get("step", 0) >= skip:
            spy = _pyspy(proc.pid, spy_out)
        if proc.poll() is not None:
            break
        if stop_early and recs and recs[-1].get("step", 0) >= steps:
            _stop(proc)  # the last step is logged; skip the final 12 GB checkpoint
            stopped = True
            break
        if time.perf_counter() - t0 > timeout:
            _stop(proc)
            timed_out = True
            break
        time.sleep(0.5)
    wall = time.perf_counter() - t0
    if spy is not None:
        out_spy = _pyspy_done(spy, spy_out)
    recs = _records(metrics)
    steady = [r for r in recs if r.get("step", 0) > skip]
    out = {"cmd": " ".join(cmd), "gpus": gpus, "steps_asked": steps, "steps_logged": len(recs),
           "steady_steps": len(steady), "skipped_first_steps": skip, "num_workers": workers,
           "wall_s": round(wall, 1), "time_to_first_step_s": round(first_step_s, 1) if first_step_s else None,
           "returncode": proc.returncode, "stopped_after_last_step": stopped, "timed_out": timed_out}
    if steady:
        tok = [r["ctx_tokens_per_s"] for r in steady]
        dts = [r["ctx_tokens"] / r["ctx_tokens_per_s"] for r in steady if r.get("ctx_tokens") and r["ctx_tokens_per_s"]]
        if dts:  # all steady steps together: tokens over time, and the share of that time spent waiting
            out["ctx_tokens_per_s_overall"] = round(sum(r["ctx_tokens"] for r in steady) / sum(dts))
            out["data_wait_frac_overall"] = round(sum(r.get("data_wait_frac", 0) * d for r, d in zip(steady, dts)) / sum(dts), 4)
            out["gc_frac_overall"] = round(sum(r.get("gc_frac", 0) * d for r, d in zip(steady, dts)) / sum(dts), 4)
            # the training thread's step by phase, mean over the steady steps (shares of host intervals)
            out["host_phase_frac_mean"] = {k: round(float(np.mean([r.get(f"host_{k}_frac", 0) for r in steady])), 4)
                                           for k in HOST_PHASES}
        out.update({
            "ctx_tokens_per_s_median": round(median(tok)),
            "ctx_tokens_per_s_mean": round(float(np.mean(tok))),
            "block_tokens_per_s_median": round(median([r["block_tokens_per_s"] for r in steady])),
            "data_wait_frac_mean": round(float(np.mean([r.get("data_wait_frac", 0) for r in steady])), 3),
            "data_wait_frac_max": round(float(np.max([r.get("data_wait_frac", 0) for r in steady])), 3),
            "peak_mem_gb": max(r.get("peak_mem_gb", 0) for r in steady),
            "compiles": steady[-1].get("compiles"), "recompiles": steady[-1].get("recompiles"),
            "loss_first_last": [recs[0].get("loss"), recs[-1].get("loss")],
            # every steady step: [step, ctx tok/s, data-wait fraction, GC fraction, host phase fractions
            # in HOST_PHASES order] (where a stall happened, and what the host did meanwhile)
            "per_step_fields": ["step", "ctx_tokens_per_s", "data_wait_frac", "gc_frac"] + [f"host_{k}_frac" for k in HOST_PHASES],
            "per_step": [[r.get("step"), round(r.get("ctx_tokens_per_s", 0)), round(r.get("data_wait_frac", 0), 4),
                          round(r.get("gc_frac", 0), 4)] + [round(r.get(f"host_{k}_frac", 0), 3) for k in HOST_PHASES]
                         for r in steady],
        })
    if not recs or proc.returncode not in (0, None, -signal.SIGKILL) or timed_out:
        out["log_tail"] = log.read_text()[-3000:]
    for table in sorted((run / "profile").glob("rank*.txt")):
        shutil.copy(table, out_dir() / f"train_profile_{tag}_{table.name}")
    for trace in sorted((run / "profile").glob("rank*.trace.json")):  # GPU idle gaps: the traces stay here
        import trace_gaps

        with contextlib.suppress(Exception):
            out.setdefault("trace_gaps", {})[trace.name.split(".")[0]] = trace_gaps.summarize_file(trace)
    final = run / "metrics.json"
    if final.is_file():
        out["metrics_json"] = json.loads(final.read_text())
    if spy is not None:
        out["pyspy"] = out_spy
    return out


def _pyspy(pid: int, path: Path):
    """BENCH_TRAIN_PYSPY=tag,...: py-spy samples, over the steady steps, which thread of each process of the
    run holds the GIL (collapsed stacks, one line per stack and thread, to $OUT/pyspy_<tag>.txt; the
    sampler does not pause the processes).  Best effort: a host without ptrace rights gets an error line."""
    exe = shutil.which("py-spy") or str(Path(sys.prefix) / "bin" / "py-spy")
    for d in (os.environ.get("PYTHONPATH") or "").split(os.pathsep):  # pip --target puts it in <dir>/bin
        if d and (Path(d) / "bin" / "py-spy").is_file():
            exe = str(Path(d) / "bin" / "py-spy")
    dur = os.environ.get("BENCH_TRAIN_PYSPY_S", "25")
    cmd = [exe, "record", "--pid", str(pid), "--subprocesses", "--gil", "--threads", "--nonblocking",
           "--rate", "200", "--duration", dur, "--format", "raw", "--output", str(path)]
    try:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as e:
        return e


def _pyspy_done(spy, path: Path) -> dict:
    if isinstance(spy, OSError):
        return {"error": str(spy)}
    try:
        log, _ = spy.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        spy.kill()
        log, _ = spy.communicate()
    res = {"returncode": spy.returncode, "log_tail": (log or "")[-600:]}
    if path.is_file():
        res.update(gil_holders(path))
    return res


def gil_holders(path: Path, top: int = 12) -> dict:
    """Sample counts by (process, thread) and the heaviest leaf frames of each, from py-spy's raw output
    (`frame;frame;... count`, the first frames naming the process and thread)."""
    by_thread, leaves = {}, {}
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        procs = [f for f in frames if f.startswith("process ")]
        thread = next((f for f in frames if f.startswith("thread ")), "thread ?")
        pid, _, cmd = procs[-1].partition(":") if procs else ("process ?", "", "")
        key = f"{pid} {cmd.strip(chr(34))[-48:]} | {thread}"
        by_thread[key] = by_thread.get(key, 0) + int(n)
        leaf = leaves.setdefault(key, {})
        for f in frames[-3:]:
            leaf[f] = leaf.get(f, 0) + int(n)
    ranked = sorted(by_thread.items(), key=lambda kv: -kv[1])[:top]
    return {"gil_samples_by_thread": dict(ranked),
            "top_frames": {k: dict(sorted(leaves[k].items(), key=lambda kv: -kv[1])[:8]) for k, _ in ranked[:6]}}


def part_scaling(tiny: bool, limit: float) -> None:
    res = Results("train_scaling", tiny=tiny, limit_s=limit, shapes=shapes(tiny))
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    one, two = ("cpu:1", "cpu:2") if tiny or n_gpu == 0 else ("0", "0,1")
    steps, skip = (4, 1) if tiny else (int(os.environ.get("BENCH_TRAIN_STEPS", "25")), int(os.environ.get("BENCH_TRAIN_SKIP", "5")))
    workers = 1 if tiny else int(os.environ.get("BENCH_TRAIN_WORKERS", "8"))
    # BENCH_TRAIN_SET="key=value,...": train settings of all runs (JSON values, e.g. gc_every=0);
    # BENCH_TRAIN_AB: settings of one more two-GPU run after them (same call, same host: a before/after),
    # and with BENCH_TRAIN_AB_1GPU=1 of one more one-GPU run too
    base, ab = _settings(os.environ.get("BENCH_TRAIN_SET")), os.environ.get("BENCH_TRAIN_AB") or None
    two_ok = tiny or n_gpu >= 2
    runs = [("gpus_2", two, "g2", base)] if two_ok else []
    runs.append(("gpus_1", one, "g1", base))
    if ab and two_ok:
        runs.append(("gpus_2_ab", two, "g2ab", {**base, **_settings(ab)}))
    if ab and os.environ.get("BENCH_TRAIN_AB_1GPU") == "1":
        runs.append(("gpus_1_ab", one, "g1ab", {**base, **_settings(ab)}))
    with res.guard("store"):
        build_store(tiny)
    if not two_ok:
        res.set("gpus_2", {"skipped": f"{n_gpu} GPU(s) visible"})
    # two GPUs first: the number this part exists for; each run gets an even share of what is left
    # (a two-GPU run 1.2 shares: it compiles in two processes)
    for i, (key, gpus, tag, settings) in enumerate(runs):
        left = limit - elapsed() - 5
        shares = [1.2 if r[1] == two else 1.0 for r in runs[i:]]
        if left < 30:
            res.set(key, {"skipped": f"time: {elapsed():.0f}s of {limit:.0f}s"})
            continue
        with res.guard(key):
            r = train_run(tiny, gpus, steps, skip, timeout=left * shares[0] / sum(shares), tag=tag, workers=workers,
                          settings=settings)
            res.set(key, {"settings": settings, **r} if settings else r)
    a = res.data.get("gpus_1", {}).get("ctx_tokens_per_s_median")
    b = res.data.get("gpus_2", {}).get("ctx_tokens_per_s_median")
    res.set("scaling_2_over_1", round(b / a, 3) if a and b else None)
    a = res.data.get("gpus_1", {}).get("ctx_tokens_per_s_overall")
    b = res.data.get("gpus_2", {}).get("ctx_tokens_per_s_overall")
    res.set("scaling_2_over_1_overall", round(b / a, 3) if a and b else None)
    a = res.data.get("gpus_1_ab", {}).get("ctx_tokens_per_s_overall")
    b = res.data.get("gpus_2_ab", {}).get("ctx_tokens_per_s_overall")
    if a and b:
        res.set("scaling_2_over_1_overall_ab", round(b / a, 3))
    res.set("note", "ctx_tokens_per_s is global (all processes) per optimizer step, median over the steps after "
                    "the first `skipped_first_steps` (compile, warm-up); each process has its own DataLoader")
    res.set("wall_s", round(elapsed(), 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["loader", "scaling", "host"], required=True)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    tiny = tiny_mode(args.tiny)
    if args.part == "loader":
        part_loader(tiny, part_limit_s(95))
    elif args.part == "host":
        from host_profile import part_host

        res = Results("host_profile", tiny=True)
        with res.guard("host"):
            part_host(res, _settings(os.environ.get("BENCH_TRAIN_SET")))
    else:
        part_scaling(tiny, part_limit_s(250))


if __name__ == "__main__":
    main()
