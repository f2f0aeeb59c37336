"""What an epoch boundary costs a training run: each later epoch's first step against its other steps.

    python bench/epoch_restart.py --store stores/heldout --target data/target_model [--workers 8]
        [--steps 120] [--out epoch_restart.json] [-- extra train flags]

Runs `dflash train` (a fresh run directory, the drafter eager on the CPU, small rows so that a small
store's epochs are a few steps) and reads its metrics: a step's seconds are its context tokens over its rate;
an epoch's first step pays the boundary (the DataLoader's workers, the first micro-batch), so its excess
over the median of that epoch's other steps is the boundary's cost.  Reports each boundary's excess, the
median, and the run's wall time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common  # noqa: F401  (puts the repo root on sys.path)


def step_seconds(row: dict) -> float:
    return row["ctx_tokens"] / row["ctx_tokens_per_s"]


def boundaries(rows: list[dict]) -> list[float]:
    """Excess seconds of each epoch's first step (the first epoch's is start-up, left out)."""
    by_epoch: dict[int, list[dict]] = {}
    for r in rows:
        by_epoch.setdefault(r["epoch"], []).append(r)
    out = []
    for e, steps in sorted(by_epoch.items()):
        if e == min(by_epoch) or len(steps) < 3:
            continue
        rest = statistics.median(step_seconds(r) for r in steps[1:])
        out.append(step_seconds(steps[0]) - rest)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--out", default="epoch_restart.json")
    ap.add_argument("extra", nargs="*", help="more `dflash train` flags (after --)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "dflash.cli", "train", "--store", a.store, "--target", a.target, "--out", str(run),
               "--gpus", "cpu:1", "--compile", "off", "--steps", str(a.steps), "--num-workers", str(a.workers),
               "--save-every", "0", "--eval-every", "0", "--rows-per-batch", "1", "--token-budget", "1024", *a.extra]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    excess = boundaries(rows)
    res = {"workers": a.workers, "steps": a.steps, "epochs": len({r["epoch"] for r in rows}), "wall_s": wall,
           "final_loss": rows[-1]["loss"],
           "median_step_s": statistics.median(step_seconds(r) for r in rows[1:]),
           "boundary_excess_s": excess, "median_boundary_excess_s": statistics.median(excess) if excess else None}
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(json.dumps({k: v for k, v in res.items() if k != "boundary_excess_s"}))
    print("boundary excess (s):", " ".join(f"{x:.3f}" for x in excess))


if __name__ == "__main__":
    main()
