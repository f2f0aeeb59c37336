"""Seconds per step of each batch shape ALONE on the device, with the processes' start hidden.

A run's start (imports, CUDA, the store, 4 DataLoader workers, the first steps' kernels) took 20-40 s on the
H200 in session 11, far longer than the ~100 steady steps a step time needs; seven shapes one after another
would not fit one device call beside the study.  So every shape's `dflash train` (bench/recipe_study.py's
config: params.yaml's train section, the setup's base, the config's overrides; --num-workers 4, eval off,
seed 0) is started at once, while the study still runs, and each process group is stopped (SIGSTOP) as soon as
it has logged its first step.  Once the study has ended (--go-file exists), the shapes are resumed one at a
time (SIGCONT), nothing else running on the device: each steps `--measure` more steps and is then killed.
Its step is the median, over those steps less the first 10 after the resume, of the step on the device's
timeline (ctx_tokens / ctx_tokens_per_s of metrics.jsonl, as recipe_study's step_s_median).

    python3 alone.py --setup c:/tmp/c/target:/tmp/c/data/train.jsonl:/tmp/c/data/heldout.jsonl:cli5 \\
        --configs c_base,c_l1,... --work /tmp/recipe_c --go-file /tmp/study_done --end-at UNIX --out $OUT/alone

The stores are the study's (recipe_study.py --work, the same layer rule).  Output: OUT/recipe.json in
recipe_study's format (one record per shape: config, overrides, base, step_s_median, ...), which
`recipe_study.py --plot-gpu-s-from` takes as its timing file.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
import yaml  # noqa: E402

import recipe_study as rs  # noqa: E402


def records(run: Path) -> list[dict]:
    f = run / "metrics.jsonl"
    if not f.exists():
        return []
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip().endswith("}")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setup", required=True)
    ap.add_argument("--configs", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--go-file", required=True, help="measure once this file exists (the study has ended)")
    ap.add_argument("--end-at", type=float, required=True, help="unix time: give up then")
    ap.add_argument("--measure", type=int, default=90, help="steps after the resume (the first 10 are dropped)")
    ap.add_argument("--shape-timeout-s", type=float, default=13.0)
    ap.add_argument("--max-start-s", type=float, default=60.0, help="after the go file: how long to wait for the "
                    "shapes still starting to log their first step")
    ap.add_argument("--num-workers", type=int, default=4)
    ap.add_argument("--gpus", default="0")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from dflash.target.files import default_target_layers

    name, target, train, heldout, *base = args.setup.split(":")
    sbase = rs.SETUP_BASES[base[0]] if base else {}
    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n_target = json.loads((Path(target) / "config.json").read_text())["num_hidden_layers"]
    procs = {}
    t0 = time.time()
    for c in args.configs.split(","):
        ov = rs.CONFIGS[c]
        layers = ov.get("target_layers") or default_target_layers(n_target, {**rs.BASE, **sbase, **ov}["num_layers"])
        key = "l" + "_".join(map(str, layers))
        run = work / "alone" / f"{c}_s0_alone"
        job = {"overrides": ov, "base": sbase, "num_workers": args.num_workers, "seed": 0, "steps": 5000,
               "stores": {"train": work / name / f"train_{key}", "heldout": work / name / f"heldout_{key}"},
               "target": target, "run": str(run), "gpus": args.gpus, "eval_every": 0, "compile": "off"}
        run.mkdir(parents=True, exist_ok=True)
        cfg = run.parent / f"{run.name}.yaml"
        cfg.write_text(yaml.safe_dump(rs.train_params(job)))
        log = open(run.parent / f"{run.name}.log", "w")
        p = subprocess.Popen(rs.dflash("train", "--config", str(cfg), "--overwrite"), stdout=log,
                             stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        procs[c] = {"p": p, "run": run, "ov": ov, "layers": layers, "stopped": False}
        print(f"t={time.time() - t0:.0f}s started {c} (pid {p.pid})", flush=True)

    def stop(c: str, why: str) -> None:
        try:
            os.killpg(procs[c]["p"].pid, signal.SIGSTOP)
        except ProcessLookupError:
            return
        procs[c]["stopped"] = True
        print(f"t={time.time() - t0:.0f}s stopped {c} at step {len(records(procs[c]['run']))} ({why})", flush=True)

    # Stop each as soon as it has logged a step; once the study has ended (the go file), wait for the rest
    # to log theirs, at most --max-start-s, then stop any still starting.
    go_t = None
    while time.time() < args.end_at:
        for c, d in procs.items():
            if not d["stopped"] and d["p"].poll() is None and records(d["run"]):
                stop(c, "first step logged")
        if go_t is None and Path(args.go_file).exists():
            go_t = time.time()
        if go_t is not None and (all(d["stopped"] or d["p"].poll() is not None for d in procs.values())
                                 or time.time() - go_t > args.max_start_s):
            break
        time.sleep(0.2)
    for c, d in procs.items():
        if not d["stopped"] and d["p"].poll() is None:
            stop(c, "the study has ended")
    results = []
    for c, d in procs.items():
        p, run = d["p"], d["run"]
        rec = {"setup": name, "config": c, "seed": 0, "overrides": d["ov"], "base": sbase,
               "num_workers": args.num_workers, "target_layers": d["layers"], "heldout_tau": None, "curve": []}
        if p.poll() is not None:
            rec["error"] = f"exited {p.returncode} before its turn; see {run.name}.log"
        elif time.time() > args.end_at - 5:
            rec["error"] = "no time left"
        else:
            n0 = len(records(run))
            ts = time.time()
            os.killpg(p.pid, signal.SIGCONT)
            while (len(records(run)) < n0 + args.measure and p.poll() is None
                   and time.time() - ts < args.shape_timeout_s and time.time() < args.end_at):
                time.sleep(0.1)
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rs_ = records(run)[n0 + 10:]
            step = sorted(r["ctx_tokens"] / r["ctx_tokens_per_s"] for r in rs_ if r.get("ctx_tokens_per_s"))
            rec.update({"resumed_at_step": n0, "steps": len(rs_) + n0 + 10 if rs_ else n0, "steps_measured": len(step),
                        "measure_wall_s": round(time.time() - ts, 1),
                        "step_s_median": step[len(step) // 2] if step else None,
                        "data_wait_frac_median": statistics.median(r["data_wait_frac"] for r in rs_) if rs_ else None,
                        "samples_per_step": statistics.mean(r["samples"] for r in rs_) if rs_ else None,
                        "block_tokens_per_step": statistics.mean(r["block_tokens_per_s"] * r["ctx_tokens"] /
                                                                 r["ctx_tokens_per_s"] for r in rs_) if rs_ else None})
        print(json.dumps(rec), flush=True)
        results.append(rec)
        (out / "recipe.json").write_text(json.dumps({"runs": results, "method": __doc__.split("\n\n")[1]}, indent=1))
    for d in procs.values():  # anything left (an error above): not left stopped on the device
        if d["p"].poll() is None:
            os.killpg(d["p"].pid, signal.SIGKILL)
            d["p"].wait()


if __name__ == "__main__":
    main()
