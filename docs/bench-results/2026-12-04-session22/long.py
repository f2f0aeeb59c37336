"""Session 22's driver: the example's defaults (`DT`: DFlash2 + D-PACE, --labels target, block 16, 3 layers,
8 rows a step) in one run ALONE on the H200 for a cosine of STEPS steps (sized to ~18 minutes at session
21's alone rate), then online evals of its last checkpoint and of those at 1/4, 1/2 and 3/4 of the run.

Nothing runs beside the trainer, so its wall time is its GPU time: the online reference is made after
training, by the last checkpoint's eval (alone, EVAL_WORKERS_FINAL processes), and the other evals then run
at once.  The layout (c4.sh), the stores, the process handling, progress.log and `collect` are session 21's
study.py, imported, so the two sessions' figures are made the same way.

Env: STEPS, EVERY (checkpoint and held-out tau), WORKERS_DT (loader workers), DEADLINE (epoch seconds: the
trainer is stopped there at the latest and its last checkpoint evaluated), EVAL_WORKERS_FINAL, EVAL_WORKERS_DT.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-12-04-session21"))
os.environ.setdefault("RUNS", "DT")
import study as s  # noqa: E402

STEPS = int(os.environ.get("STEPS", 18000))
EVERY = os.environ.get("EVERY", "1500")
DEADLINE = float(os.environ.get("DEADLINE", time.time() + 1320))


def stores() -> bool:
    """The held-out store of the target's own replies (held-out tau) and `all`, written at once."""
    n_train, n_held = s.split_generated()
    s.log(f"regenerated: {n_train} training, {n_held} held-out samples")
    pre = {"heldout_gen": s.bg("precompute_heldout_gen", s.DF + ["precompute", "--data", "data/heldout_gen.jsonl",
                                                                   "--out", "stores/heldout_gen", "--hidden-dtype",
                                                                   "bf16", "--final-hidden"]),
           "all": s.bg("precompute_all", s.DF + ["precompute", "--data", "data/train.jsonl", "--out", "stores/all"]
                       + s.ALL_ARGS)}
    ok = True
    for k, p in pre.items():
        s.log(f"precompute_{k}: exit {p.wait()}")
        ok = ok and p.returncode == 0
    return ok


def train() -> None:
    every = ["--save-every", EVERY, "--eval-every", EVERY, "--eval-store", "stores/heldout_gen"]
    p = s.bg("train_DT", s.train_cmd("DT", "all", STEPS, s.RUNS["DT"][1], every))
    while p.poll() is None:
        with open(s.E / "progress.log", "a") as f:  # study.py's format: its collect reads the wall minutes
            f.write(json.dumps({"t": round(time.time(), 1), "alive": ["DT"], "evals": 0, "gpu": "",
                                "steps": {"DT": s.last_step("DT")}}) + "\n")
        if time.time() > DEADLINE:
            s.log(f"train_DT: stopped at the deadline (step {s.last_step('DT')})")
            s.stop(p)
            break
        time.sleep(5)
    s.log(f"train_DT: exit {p.wait()} at step {s.last_step('DT')}")


def evaluate() -> None:
    cks = s.checkpoints("DT")
    if not cks:
        return s.log("driver: no checkpoint to evaluate")
    last = int(cks[-1].name.split("-")[1])
    mids = []
    for frac in (0.25, 0.5, 0.75):
        past = [c for c in cks[:-1] if int(c.name.split("-")[1]) >= frac * last]
        if past and past[0] not in mids:
            mids.append(past[0])
    os.environ["EVAL_WORKERS_DT"] = os.environ.get("EVAL_WORKERS_FINAL", "14")
    s.run(f"eval_DT@{cks[-1].name}", s.eval_cmd("DT", cks[-1]))  # writes eval/reference.json
    os.environ["EVAL_WORKERS_DT"] = os.environ.get("EVAL_WORKERS_MID", "5")
    procs = [s.bg(f"eval_DT@{c.name}", s.eval_cmd("DT", c)) for c in mids]
    for c, p in zip(mids, procs):
        s.log(f"eval DT@{c.name}: exit {p.wait()}")


def setup(banner: str) -> bool:
    """The layout's log folders, the target stage (unless done) and the stores; False (logged) on a failure."""
    (s.E / "logs").mkdir(exist_ok=True)
    (s.E / "eval").mkdir(exist_ok=True)
    s.log(banner)
    if not (s.E / "model/config.json").exists() and s.run("target", [sys.executable, "stages/target.py"], 300):
        s.log("driver: the target stage failed; stopping")
        return False
    if not stores():
        s.log("driver: a store failed; stopping")
        return False
    return True


def main() -> None:
    if not setup(f"driver (session 22): DT alone, {STEPS} steps, every {EVERY}, deadline "
                 f"{time.strftime('%H:%M:%S', time.gmtime(DEADLINE))}"):
        return
    train()
    evaluate()
    s.log("driver: done")


def guarded(fn) -> None:
    """Run a driver's main: a crash goes to study.log (the watch scripts read it), not to a lost stderr."""
    try:
        fn()
    except Exception:
        import traceback

        s.log("driver: crashed\n" + traceback.format_exc())


if __name__ == "__main__":
    guarded(main)
