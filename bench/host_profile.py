"""The host's cost of a `dflash train` step: `python bench/loader_bench.py --part host [--tiny]`.

The real trainer (`dflash.train.trainer.Trainer.train`, launched in this process on the CPU through
`launch_train`) runs on the bench store with tiny shapes, where the arithmetic is negligible and what a step
costs is what the GPU's host also runs: Python, dispatch, the feeder and loader hand-off, the tracker, the
optimizer's bookkeeping.  A step window after the warm-up is measured in separate runs: plainly (wall ms
per step, and the training thread's CPU ms per step, which a busy machine disturbs less); under cProfile
(the functions by cumulative ms per step, and the calls that are host syncs on a GPU, `.item()`,
`.tolist()`, `.cpu()`, `synchronize`, with their callers' file:line); and over BENCH_HOST_SCAN_STEPS (3)
steps under a dispatch mode that lists the ATen ops that sync on a GPU (`_local_scalar_dense`, `nonzero`,
boolean-mask indexing, ...) with their dflash file:line, which cProfile cannot see.  Each repeat is a
fresh run; the medians go to $OUT/host_profile.json, the profile tables to $OUT/host_profile_<i>.txt (and
.prof, for pstats).

Knobs (environment): BENCH_HOST_STEPS (window, 40), BENCH_HOST_SKIP (steps before it, 5), BENCH_HOST_REPEATS
(3), BENCH_HOST_WORKERS (loader workers, 1), BENCH_TRAIN_ROWS (rows a step, 8), BENCH_TRAIN_SET (train
settings, as --part scaling).  The defaults are the SmolLM2 example's step at tiny width: dflash2 + D-PACE,
`labels: rollout`, one shape.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import time
import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from common import median, out_dir, work_dir

# Calls that wait for the device on a GPU: reads of a tensor's values, and ops whose output size depends on
# them.  (A tensor's bool(), float() or a boolean-mask index are C slots cProfile does not see.)
SYNC_NAMES = ("item", "tolist", "cpu", "synchronize", "numpy", "nonzero", "masked_select", "unique",
              "repeat_interleave", "argwhere")


# ATen ops that wait for the device on a GPU (a boolean-mask index runs a nonzero first); dispatched ops are
# seen where cProfile sees nothing (float(t), bool(t), t[mask] = v).
SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_consecutive",
            "is_nonzero", "equal", "allclose")


class SyncScan(TorchDispatchMode):
    """Every ATen op in its scope that would be a host sync on a GPU, by (op, innermost dflash file:line)."""

    def __init__(self):
        super().__init__()
        self.found: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        bool_index = name in ("index", "index_put", "index_put_", "_index_put_impl_") and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bool
            for a in args if isinstance(a, (list, tuple)) for t in a)
        counted = (name in SYNC_OPS or bool_index
                   or (name == "repeat_interleave" and (kwargs or {}).get("output_size") is None
                       and isinstance(args[0], torch.Tensor) and len(args) < 2))
        if counted:
            frames = [f for f in traceback.extract_stack()[:-1] if "/dflash/" in f.filename]
            where = (f"{frames[-1].filename.split('/dflash/', 1)[1]}:{frames[-1].lineno}({frames[-1].name})"
                     if frames else "outside dflash")
            self.found[(name + (" [bool mask]" if bool_index else ""), "dflash/" + where if frames else where)] += 1
        return func(*args, **(kwargs or {}))

    def per_step(self, steps: int) -> list[dict]:
        return [{"op": op, "per_step": round(n / steps, 2), "where": where}
                for (op, where), n in self.found.most_common()]


class WindowProfiler:
    """Stands in for the trainer's StepProfiler (same calls): the wall time of steps [start, start + steps)
    and, with `profile`, a cProfile of them."""

    last: WindowProfiler | None = None

    def __init__(self, out, rank, start, steps, device, *, window: tuple[int, int], profile: bool,
                 scan: bool = False):
        self.start, self.end = window
        self.prof = cProfile.Profile() if profile else None
        self.scan = SyncScan() if scan else None
        self.t0 = self.t1 = self.cpu0 = self.cpu1 = None
        WindowProfiler.last = self

    def before_step(self, steps_run: int) -> None:
        if steps_run == self.start:
            self.t0, self.cpu0 = time.perf_counter(), time.thread_time()
            if self.prof is not None:
                self.prof.enable()
            if self.scan is not None:
                self.scan.__enter__()

    def after_step(self, steps_run: int) -> None:
        if steps_run == self.end and self.t1 is None:
            if self.scan is not None:
                self.scan.__exit__(None, None, None)
            if self.prof is not None:
                self.prof.disable()
            self.t1, self.cpu1 = time.perf_counter(), time.thread_time()

    def close(self) -> None:
        pass


def _train_config(settings: dict, steps: int):
    from dflash.config import TrainConfig
    from dflash.config.load import build_config
    from loader_bench import build_store, shapes

    tdir, store, _ = build_store(True)
    sh, w = shapes(True), work_dir()
    # Short rows and one layer: the arithmetic is negligible, what is left is the host's share of a step.
    values = {"num_layers": 1, "block_size": sh["block_size"], "token_budget": 64, "num_anchors": 2, "num_shapes": 1, "compile": "off", "warmup_steps": 5,
              "steps": steps, "save_every": 0, "arch": "dflash2", "loss": "dpace", "labels": "rollout",
              "rows_per_batch": int(os.environ.get("BENCH_TRAIN_ROWS", "8")),
              "num_workers": int(os.environ.get("BENCH_HOST_WORKERS", "1")), **settings}
    params = w / "params_host.yaml"
    params.write_text("train:\n" + "".join(f"  {k}: {json.dumps(v)}\n" for k, v in values.items()))
    flags = {"store": str(store), "target": str(tdir), "out": str(w / "run_host"), "gpus": "cpu", "overwrite": True}
    return build_config(TrainConfig, params, flags), values


def _run(settings: dict, skip: int, steps: int, profile: bool, scan: bool = False) -> WindowProfiler:
    from dflash.train import trainer
    from dflash.train.launch import launch_train

    cfg, _ = _train_config(settings, skip + steps)
    real = trainer.StepProfiler
    trainer.StepProfiler = lambda *a: WindowProfiler(*a, window=(skip, skip + steps), profile=profile,
                                                      scan=scan)
    try:
        launch_train(cfg)
    finally:
        trainer.StepProfiler = real
    return WindowProfiler.last


def _where(func: tuple) -> str:
    file, line, name = func
    for root in ("/dflash/", "/torch/"):
        if root in file:
            file = root.strip("/") + "/" + file.split(root, 1)[1]
            break
    return f"{file}:{line}({name})" if line else name


def _tables(prof: cProfile.Profile, steps: int, top: int) -> tuple[list, list, str]:
    """(top functions by cumulative ms/step, sync calls per step with their callers, the printed table)."""
    st = pstats.Stats(prof)
    rows = []
    for func, (_, nc, tt, ct, _callers) in st.stats.items():
        rows.append({"function": _where(func), "calls_per_step": round(nc / steps, 2),
                     "cum_ms_per_step": round(ct * 1e3 / steps, 3), "self_ms_per_step": round(tt * 1e3 / steps, 3)})
    rows.sort(key=lambda r: -r["cum_ms_per_step"])
    syncs = []
    for func, (*_, callers) in st.stats.items():
        _, _, name = func
        method = (name.split("'")[1] if name.startswith("<method '")
                  else name.split()[2] if name.startswith("<built-in method ") else None)
        if method in SYNC_NAMES and ("torch" in name or "Tensor" in name or "Event" in name):
            for caller, c in callers.items():
                syncs.append({"call": method, "per_step": round(c[1] / steps, 2), "caller": _where(caller)})
    syncs.sort(key=lambda r: -r["per_step"])
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(top)
    return rows[:top], syncs, buf.getvalue()


def part_host(res, settings: dict) -> None:
    steps = int(os.environ.get("BENCH_HOST_STEPS", "40"))
    skip = int(os.environ.get("BENCH_HOST_SKIP", "5"))
    repeats = int(os.environ.get("BENCH_HOST_REPEATS", "3"))
    _, values = _train_config(settings, skip + steps)
    res.set("settings", values)
    walls, cpus, profiled = [], [], []
    for i in range(repeats):
        w = _run(settings, skip, steps, profile=False)
        walls.append((w.t1 - w.t0) * 1e3 / steps)
        cpus.append((w.cpu1 - w.cpu0) * 1e3 / steps)
        p = _run(settings, skip, steps, profile=True)
        top, syncs, text = _tables(p.prof, steps, 80)
        (out_dir() / f"host_profile_{i}.txt").write_text(text)
        p.prof.dump_stats(str(out_dir() / f"host_profile_{i}.prof"))  # for pstats / snakeviz
        profiled.append({"wall_ms_per_step_profiled": round((p.t1 - p.t0) * 1e3 / steps, 3), "top": top,
                         "syncs": syncs})
        print(json.dumps({"repeat": i, "wall_ms_per_step": round(walls[-1], 3),
                          "thread_cpu_ms_per_step": round(cpus[-1], 3)}), flush=True)
    res.set("steps", steps)
    res.set("skipped_first_steps", skip)
    res.set("wall_ms_per_step", [round(x, 3) for x in walls])
    res.set("wall_ms_per_step_median", round(median(walls), 3))
    # The training thread's CPU time: what the host spends on a step, less the waits that another
    # process on a shared machine adds to the wall time (the loader's workers run in their own processes).
    res.set("thread_cpu_ms_per_step", [round(x, 3) for x in cpus])
    res.set("thread_cpu_ms_per_step_median", round(median(cpus), 3))
    res.set("profiles", profiled)
    scan_steps = int(os.environ.get("BENCH_HOST_SCAN_STEPS", "3"))
    if scan_steps:
        res.set("sync_ops_per_step", _run(settings, skip, scan_steps, profile=False, scan=True).scan.per_step(scan_steps))
    res.set("note", "CPU, tiny shapes: host cost per optimizer step; profiles are separate runs of the same window")
