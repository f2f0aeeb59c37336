"""Written in session 23 (no GPU lent) for the next lease: session 23's two speed changes measured on the H200
(fp8 context features dequantised on the device; one lm_head pass a step for DFlash2 + D-PACE), then the
example's defaults alone for as long as the lease allows, then online evals of four of its checkpoints.

  1. the target stage and the stores (session 22's long.py: `all` in fp8, heldout_gen in bf16);
  2. A/B, each alone on the GPU, on the same store and flags as the long run, no held-out evals and no
     checkpoints: AB_STEPS steps of the code before both changes (`data/base.tar`, carried as
     .carry/base.tar.xz: `git archive f3d7ed3 dflash | xz`), then of this tree's; each run's steps/s,
     median step, data wait and starved steps from its metrics (ab.json), and its host phases (metrics);
  3. the long run (long.py's train(), STEPS steps, checkpoints and held-out tau every EVERY), its STEPS
     sized from the A/B's measured rate to end TRAIN_S seconds after it starts, unless STEPS is given;
  4. long.py's evaluate(): the last checkpoint alone (writes the reference), then those at 1/4, 1/2, 3/4,
     and with SCREEN_STEPS the screen's last checkpoints beside them.
  With SCREEN_STEPS > 0, before the long run: `--labels target` (DT's flags) against `--labels rollout`,
  SCREEN_STEPS steps each on their own cosine, alone, held-out tau at the end (runs SCR_target, SCR_rollout).

Env: AB_STEPS (0 skips the A/B), SCREEN_STEPS (0: no screen), TRAIN_S, STEPS, EVERY, WORKERS_DT, DEADLINE,
EVAL_WORKERS_FINAL, EVAL_WORKERS_MID.  Launched by session 21's c4.sh with DRIVER=docs/bench-results/2026-12-05-session23/next.py.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-12-04-session22"))
import long as lg  # noqa: E402  (it imports session 21's study.py as lg.s)

s = lg.s
AB_STEPS = int(os.environ.get("AB_STEPS", 800))
TRAIN_S = float(os.environ.get("TRAIN_S", 900))
SCREEN_STEPS = int(os.environ.get("SCREEN_STEPS", 0))
SCREEN = {"SCR_target": s.RUNS["DT"][1],
          "SCR_rollout": [f if f != "target" else "rollout" for f in s.RUNS["DT"][1]]}


def screen() -> None:
    """SCREEN_STEPS steps of each SCREEN run, one after the other, alone on the GPU."""
    every = ["--save-every", str(SCREEN_STEPS), "--eval-every", str(SCREEN_STEPS), "--eval-store", "stores/heldout_gen"]
    for name, flags in SCREEN.items():
        s.run(f"train_{name}", s.train_cmd(name, "all", SCREEN_STEPS, flags, every))
        held = [r for r in s.rows_of(s.E / "runs" / name / "metrics.jsonl") if "eval_tau" in r]
        s.log(f"{name}: held-out tau {held[-1]['eval_tau'] if held else None} at step {s.last_step(name)}")


def evaluate_screen() -> None:
    procs = [(n, c, s.bg(f"eval_{n}@{c.name}", s.eval_cmd(n, c))) for n in SCREEN
             for c in s.checkpoints(n)[-1:]] if SCREEN_STEPS else []
    for n, c, p in procs:
        s.log(f"eval {n}@{c.name}: exit {p.wait()}")


def ab_run(name: str, code: Path) -> dict:
    """AB_STEPS steps of run DT's flags with the dflash package at `code`, alone; its rates."""
    cmd = s.train_cmd(name, "all", AB_STEPS, s.RUNS["DT"][1], ["--save-every", "0", "--eval-every", "0"])
    env = dict(os.environ, PYTHONPATH=f"/root/site:{code}")
    where = subprocess.run([sys.executable, "-c", "import dflash; print(dflash.__file__)"], env=env,
                           capture_output=True, text=True).stdout.strip()
    t = time.time()
    s.log(f"{name}: started with dflash from {where}")
    with open(s.E / "logs" / f"{name}.log", "w") as out:
        rc = subprocess.run(cmd, cwd=s.E, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    rows = [r for r in s.rows_of(s.E / "runs" / name / "metrics.jsonl") if r.get("ctx_tokens_per_s")][50:]
    walls = [r["ctx_tokens"] / r["ctx_tokens_per_s"] for r in rows]
    rec = {"rc": rc, "wall_s": round(time.time() - t, 1), "steps_timed": len(rows),
           "steps_per_s": round(len(walls) / sum(walls), 2) if walls else None,
           "median_step_s": round(statistics.median(walls), 4) if walls else None,
           "data_wait": round(statistics.mean(r["data_wait_frac"] for r in rows), 4) if rows else None,
           "starved_steps": sum(r["data_wait_frac"] > 0.5 for r in rows)}
    s.log(f"{name}: {json.dumps(rec)}")
    return rec


def main() -> None:
    if not lg.setup(f"driver (session 23's plan): A/B {AB_STEPS} steps each, screen {SCREEN_STEPS}, then DT alone "
                    f"~{TRAIN_S:.0f} s"):
        return
    rate = None
    if AB_STEPS:
        base = Path(os.environ.get("BASE", "/root/base"))
        with tarfile.open(s.E / "data/base.tar") as t:
            t.extractall(base)  # our own archive (c4 carries it)
        ab = {"before": ab_run("AB_before", base), "after": ab_run("AB_after", s.CODE)}
        (s.E / "ab.json").write_text(json.dumps(ab, indent=1))
        rate = ab["after"]["steps_per_s"]
    if SCREEN_STEPS:
        screen()
    if "STEPS" not in os.environ and rate:
        # held-out evals and checkpoints every EVERY steps cost ~1.6 s each (session 21)
        lg.STEPS = max(int(lg.EVERY), int(TRAIN_S * rate * 0.93) // 500 * 500)
    lg.DEADLINE = min(lg.DEADLINE, time.time() + TRAIN_S * 1.15)
    s.log(f"driver: DT for {lg.STEPS} steps (after-rate {rate} steps/s), deadline "
          f"{time.strftime('%H:%M:%S', time.gmtime(lg.DEADLINE))}")
    lg.train()
    lg.evaluate()
    evaluate_screen()
    s.log("driver: done")


if __name__ == "__main__":
    lg.guarded(main)
