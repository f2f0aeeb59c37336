"""Session 29's plan for the next lease: the data-limited regime, screened on 4,000 conversations.

The example's defaults stop gaining online at ~2.97 on all 17K conversations while training tau still
rises (session 27), and 5 layers raise training tau but not online tau at 10,000 steps (session 29's
D5RS): the data limits the drafter.  On the first 4,000 conversations the same regime comes ~4x sooner
(an epoch is ~190 steps), so a 5,000-step cosine (~26 epochs, the defaults' ~27 on 17K) shows each
run's plateau in minutes, and several runs share the GPU (which then serialises their kernels: four
runs step ~4x slower than one, sessions 26 and 27):

  4K     the example's defaults (DR: DFlash2 + D-PACE, rollout labels, block 16, 3 layers, 8 rows) with
         one padded shape, on `stores/4k`: the 4K-against-17K point (DR's plateau 2.97, session 27)
  4K.s1  the same, seed 1: the spread between seeds
  4K.wd  + `--weight-decay 0.1` (the defaults have none)
  4K.kd  + `--kd-weight 1` (KD on the stored top-k: soft labels)
  4K.l5  + `--num-layers 5` (not in the default SCREEN: session 29's D5RS answered it on 17K)

Each walks the online prompts' own replies every EVERY steps (session 25's measure).  Only the stores
these runs read are written: the target, `stores/4k` and `stores/online_gen` (not `all` nor
`heldout_gen`), so training starts ~2 minutes into the call.

Env: as session 25's screen.py (SCREEN, STEPS, EVERY, WORKERS, DEADLINE, /root/ex/deadline).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "2026-12-05-session25"))
os.environ.setdefault("SCREEN", "4K,4K.s1,4K.wd,4K.kd")
os.environ.setdefault("STEPS", "5000")
os.environ.setdefault("EVERY", "1000")
import screen as s25  # noqa: E402

lg, s = s25.lg, s25.s
BASE = s25.RUNS["DR"] + ["--num-shapes", "1"]
s25.RUNS.update({"4K": BASE, "4K.s1": BASE + ["--seed", "1"], "4K.wd": BASE + ["--weight-decay", "0.1"],
                 "4K.kd": BASE + ["--kd-weight", "1"], "4K.l5": BASE + ["--num-layers", "5"]})
s25.STORE.update({n: "4k" for n in s25.RUNS if n.startswith("4K")})


def stores() -> bool:
    """Session 22's `all` and `heldout_gen` only when a run reads `all` (these runs read `stores/4k`)."""
    return lg_stores() if any(s25.STORE.get(n, "all") == "all" for n in s25.NAMES) else True


lg_stores, lg.stores = lg.stores, stores

if __name__ == "__main__":
    lg.guarded(s25.main)
