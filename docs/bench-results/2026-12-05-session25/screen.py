"""Session 25's plan for the next lease: a lever screen measured online by the walk.

Session 25 showed, on the real target, that the walk over the online prompts' own replies reads the
lossless eval's tau (2.3768 against 2.3757 at the same checkpoint).  So each run here evaluates on
`stores/online_gen` itself (`--eval-store stores/online_gen --eval-walk-tokens 128`): every EVERY steps its
metrics carry `eval_walk_tau`, the online tau of that checkpoint, at ~5 s instead of a ~200 s lossless eval.

  1. the target stage, the stores (session 22's: `all` in fp8, heldout_gen in bf16) and online_gen
     (session 24's: the target's fp32 greedy replies to the 100 online prompts, here in batches of
     GEN_BATCH prompts: batched and one-at-a-time fp32 replies were the same on the CPU, session 25);
  2. the runs of RUNS at once on the one GPU, each a STEPS-step cosine, until they end or DEADLINE;
  3. FINAL (a run's name, optional): one lossless online eval of its last checkpoint, the walk's check.

Runs (one change from `DT`, the example's defaults): DR `--labels rollout`; D5 `--num-layers 5`; DB
`--block-size 8` (its tau is capped at 8); DT itself.  Since session 26 (DR is the example's): DR1 DR's
second seed, D5R and DBR (5 layers, block 8, each on top of DR).

Since session 27: D5RS, D5R with one padded training shape (`--num-shapes 1`: the same batches, one
compilation instead of four); D4K, DR on a store of the first 4,000 training conversations (`stores/4k`, written
beside the others when a run needs it), for the 4K-against-17K lever; and the deadline can be moved
while the driver runs: `echo EPOCH_SECONDS > /root/ex/deadline` (session 27's was set too early and
the driver had to be killed to let its run finish).

Env: SCREEN (the runs, default DT,DR,D5), STEPS, EVERY, WORKERS (loader workers a run), DEADLINE, GEN_BATCH, FINAL,
FINAL_BY (epoch seconds: FINAL's eval is skipped unless it would end by then).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "2026-12-05-session24"))
os.environ.setdefault("RUNS", "DT")  # study.py's own table: DT's flags are the base of every run here
os.environ.setdefault("GEN_BATCH", "16")
os.environ.setdefault("GEN_GPUS", "0,0,0,0")  # read when session 24's driver is imported
import next as s24  # noqa: E402  (session 24's driver: online_gen; it imports session 22's long.py as lg)

lg, s = s24.lg, s24.lg.s
BASE = s.RUNS["DT"][1]
RUNS = {"DT": BASE, "DR": [f if f != "target" else "rollout" for f in BASE], "D5": BASE + ["--num-layers", "5"],
        "DB": BASE + ["--block-size", "8"]}
# Session 26 made DR the example's defaults; the levers on top of it, for a later screen:
RUNS.update({"DR1": RUNS["DR"] + ["--seed", "1"], "D5R": RUNS["DR"] + ["--num-layers", "5"],
             "DBR": RUNS["DR"] + ["--block-size", "8"]})
RUNS["D4K"] = RUNS["DR"]
RUNS["D5RS"] = RUNS["D5R"] + ["--num-shapes", "1"]  # one compiled training shape: the same steps, less start-up
STORE = {"D4K": "4k"}  # every other run trains on `all`
NAMES = os.environ.get("SCREEN", "DT,DR,D5").split(",")

STEPS = int(os.environ.get("STEPS", 12000))
EVERY = os.environ.get("EVERY", "2000")


def online_gen_store(gen) -> bool:
    """online_gen's store once its replies (session 24's generate, batched here) are written."""
    if gen.wait() != 0:
        return False
    return s.run("precompute_online_gen", s.DF + ["precompute", "--data", "data/online_gen.jsonl", "--out",
                                                  "stores/online_gen", "--hidden-dtype", "bf16",
                                                  "--max-length", "8192"], 300) == 0


def store_4k() -> bool:
    """`stores/4k`: the first 4,000 of the (seeded, shuffled) training conversations, as `all` is written."""
    if not any(STORE.get(n) == "4k" for n in NAMES):
        return True
    with open(s.E / "data/train.jsonl") as f, open(s.E / "data/train_4k.jsonl", "w") as out:
        out.writelines(line for _, line in zip(range(4000), f))
    return s.run("precompute_4k", s.DF + ["precompute", "--data", "data/train_4k.jsonl", "--out", "stores/4k"]
                 + s.ALL_ARGS, 300) == 0


def deadline() -> float:
    """DEADLINE, or the epoch seconds in /root/ex/deadline once a call writes them there."""
    try:
        return float((s.E / "deadline").read_text())
    except (OSError, ValueError):
        return lg.DEADLINE


def screen() -> None:
    every = ["--save-every", EVERY, "--eval-every", EVERY, "--eval-store", "stores/online_gen",
             "--eval-walk-tokens", "128"]
    procs = {n: s.bg(f"train_{n}", s.train_cmd(n, STORE.get(n, "all"), STEPS, RUNS[n], every)) for n in NAMES}
    while any(p.poll() is None for p in procs.values()):
        tick(procs)
    for n, p in procs.items():
        s.log(f"train_{n}: exit {p.returncode} at step {s.last_step(n)}")


def tick(procs: dict) -> bool:
    """One 5-s round of the screen: the runs' progress logged, those alive stopped once past the deadline
    (returns whether it is past)."""
    alive = [n for n, p in procs.items() if p.poll() is None]
    with open(s.E / "progress.log", "a") as f:  # study.py's format: collect's fair-share minutes
        f.write(json.dumps({"t": round(time.time(), 1), "alive": alive, "evals": 0, "gpu": "",
                            "steps": {n: s.last_step(n) for n in procs}}) + "\n")
    past = time.time() > deadline()
    if past:
        for n in alive:
            s.log(f"train_{n}: stopped at the deadline (step {s.last_step(n)})")
            s.stop(procs[n])
    time.sleep(5)
    return past


def main() -> None:
    (s.E / "logs").mkdir(exist_ok=True)
    (s.E / "eval").mkdir(exist_ok=True)
    s.log(f"driver (session 25's plan): {NAMES} at once, {STEPS} steps each, walk on online_gen every {EVERY}; "
          f"deadline {time.strftime('%H:%M:%S', time.gmtime(lg.DEADLINE))}")
    if not (s.E / "model/config.json").exists() and s.run("target", [sys.executable, "stages/target.py"], 300):
        return s.log("driver: the target stage failed; stopping")
    gen = s24.online_gen()  # in the background, beside the two precomputes
    if not lg.stores() or not store_4k() or not online_gen_store(gen):
        return s.log("driver: a store failed; stopping")
    screen()
    final = os.environ.get("FINAL")
    if final and time.time() + 210 > float(os.environ.get("FINAL_BY", "inf")):
        s.log(f"eval_{final}: skipped, it would not end by FINAL_BY")  # ~200 s with 14 workers (session 25)
    elif final and s.checkpoints(final):
        os.environ[f"EVAL_WORKERS_{final}"] = os.environ.get("EVAL_WORKERS_FINAL", "14")
        s.run(f"eval_{final}@{s.checkpoints(final)[-1].name}", s.eval_cmd(final, s.checkpoints(final)[-1]))
    s.log("driver: done")


if __name__ == "__main__":
    lg.guarded(main)
