"""Session 29's plan for the next lease: the data-limited regime, screened on 4,000 conversations.

The example's defaults stop gaining online at ~2.97 on all 17K conversations while training tau still
rises (session 27), and 5 layers raise training tau but not online tau at 10,000 steps (session 29's
D5RS): the data limits the drafter.  On the first 4,000 conversations the same regime comes ~4x sooner
(an epoch is ~190 steps), so a 5,000-step cosine (~26 epochs, the defaults' ~27 on 17K) shows each
run's plateau in minutes, and several runs share the GPU (which then serialises their kernels: four
runs step ~4x slower than one, sessions 26 and 27):

  4K      the example's defaults (DR: DFlash2 + D-PACE, rollout labels, block 16, 3 layers, 8 rows) with
          one padded shape, on `stores/4k`: the 4K-against-17K point (DR's plateau 2.97, session 27)
  4K.s1   the same, seed 1: the spread between seeds
  4K.wd   + `--weight-decay 0.1` (the defaults have none)
  4K.kd   + `--kd-weight 1` (KD on the stored top-k: soft labels)
  4K.gen  the defaults on `stores/4kgen`: the 4,000 conversations and SAMPLES replies of the target's own,
          sampled at temperature 0.8, to each one's first exchange (`dflash generate`): are the target's
          sampled replies more data, the one source of it this package leaves?
  4K.l5   + `--num-layers 5` (not in the default SCREEN: session 29's D5RS answered it on 17K)

Each walks the online prompts' own replies every EVERY steps (session 25's measure).  Only the stores
these runs read are written: the target, `stores/4k`, `stores/online_gen` and, for 4K.gen, the sampled
replies and `stores/4kgen` (not `all` nor `heldout_gen`).  The other runs start as soon as their stores
are written; 4K.gen starts when its store is.

Env: as session 25's screen.py (SCREEN, STEPS, EVERY, WORKERS, DEADLINE, /root/ex/deadline), and
SAMPLES (sampled replies a conversation, default 2), GEN_TOKENS (their length at most, default 256),
GEN_GPUS (the generate processes, default 0: one), GEN_BATCH_4K (rows a batch, default 32), GEN_EXTRA (more
`dflash generate` options, e.g. `--static-cache on`: session 32).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "2026-12-05-session25"))
os.environ.setdefault("SCREEN", "4K,4K.s1,4K.wd,4K.kd,4K.gen")
os.environ.setdefault("STEPS", "5000")
os.environ.setdefault("EVERY", "1000")
import screen as s25  # noqa: E402

lg, s = s25.lg, s25.s
BASE = s25.RUNS["DR"] + ["--num-shapes", "1"]
s25.RUNS.update({"4K": BASE, "4K.s1": BASE + ["--seed", "1"], "4K.wd": BASE + ["--weight-decay", "0.1"],
                 "4K.kd": BASE + ["--kd-weight", "1"], "4K.gen": BASE, "4K.l5": BASE + ["--num-layers", "5"]})
s25.STORE.update({n: "4k" for n in s25.RUNS if n.startswith("4K")} | {"4K.gen": "4kgen"})
NAMES, SAMPLES = s25.NAMES, int(os.environ.get("SAMPLES", 2))


def sampled_replies():
    """Background: SAMPLES sampled replies of the target to the first exchange of each of the first 4,000
    training conversations (each prompt SAMPLES times in one file: a row's sample is seeded by its place)."""
    with open(s.E / "data/train.jsonl") as f:
        rows = [json.loads(line) for _, line in zip(range(4000), f)]
    with open(s.E / "data/prompts_4k.jsonl", "w") as out:
        for k in range(SAMPLES):
            for r in rows:
                out.write(json.dumps({"id": f"{r['id']}.s{k}", "messages": r["messages"][:2]}, ensure_ascii=False) + "\n")
    return s.bg("generate_4k", s.DF + ["generate", "--data", "data/prompts_4k.jsonl", "--out", "data/gen_4k.jsonl",
                                       "--turns", "last", "--max-new-tokens", os.environ.get("GEN_TOKENS", "256"), "--temperature", "0.8",
                                       "--batch-size", os.environ.get("GEN_BATCH_4K", "32"), "--gpus", os.environ.get("GEN_GPUS", "0"),
                                       "--overwrite"] + os.environ.get("GEN_EXTRA", "").split())


def precompute_4kgen():
    """Background, once the sampled replies are written: `stores/4kgen`, the 4,000 conversations and them."""
    with open(s.E / "data/train.jsonl") as f, open(s.E / "data/train_4kgen.jsonl", "w") as out:
        out.writelines(line for _, line in zip(range(4000), f))
        out.write((s.E / "data/gen_4k.jsonl").read_text())
    return s.bg("precompute_4kgen", s.DF + ["precompute", "--data", "data/train_4kgen.jsonl", "--out", "stores/4kgen"]
                + s.ALL_ARGS)


def screen(gen) -> None:
    """Session 25's screen loop, with 4K.gen started once its store is written (gen: its chain, or None)."""
    every = ["--save-every", s25.EVERY, "--eval-every", s25.EVERY, "--eval-store", "stores/online_gen",
             "--eval-walk-tokens", "128"]
    start = lambda n: s.bg(f"train_{n}", s.train_cmd(n, s25.STORE.get(n, "all"), s25.STEPS, s25.RUNS[n], every))  # noqa: E731
    procs = {n: start(n) for n in NAMES if n != "4K.gen"}
    pre = None
    while gen or pre or any(p.poll() is None for p in procs.values()):
        if gen and gen.poll() is not None:
            s.log(f"generate_4k: exit {gen.returncode}")
            pre, gen = (precompute_4kgen() if gen.returncode == 0 else None), None
        if pre and pre.poll() is not None:
            s.log(f"precompute_4kgen: exit {pre.returncode}")
            if pre.returncode == 0 and time.time() < s25.deadline():
                procs["4K.gen"] = start("4K.gen")
            pre = None
        if s25.tick(procs):
            for p in (gen, pre):
                if p:
                    s.stop(p)
            gen = pre = None
    for n, p in procs.items():
        s.log(f"train_{n}: exit {p.returncode} at step {s.last_step(n)}")


def main() -> None:
    (s.E / "logs").mkdir(exist_ok=True)
    (s.E / "eval").mkdir(exist_ok=True)
    s.log(f"driver (session 29's plan): {NAMES} at once, {s25.STEPS} steps each, walk on online_gen every "
          f"{s25.EVERY}; {SAMPLES} sampled replies a conversation for 4K.gen; "
          f"deadline {time.strftime('%H:%M:%S', time.gmtime(s25.deadline()))}")
    if not (s.E / "model/config.json").exists() and s.run("target", [sys.executable, "stages/target.py"], 300):
        return s.log("driver: the target stage failed; stopping")
    online = s25.s24.online_gen()
    gen = sampled_replies() if "4K.gen" in NAMES else None
    if not s25.store_4k() or not s25.online_gen_store(online):
        return s.log("driver: a store failed; stopping")
    screen(gen)
    s.log("driver: done")


if __name__ == "__main__":
    lg.guarded(main)
