"""Session 30's plan for the next lease: the example's defaults with KD on all 17K conversations, alone.

Session 30's 4K screen found KD on the stored top-k (`--kd-weight 1`) +0.03 online above the seeds'
spread, the size of the defaults' gap to 3.0 (they plateau at 2.97-2.98 on 17K, session 27). Session
25's driver (target, stores `all` and `heldout_gen`, the online prompts' replies and `stores/online_gen`,
then the runs of SCREEN at once, the walk on online_gen every EVERY steps) with these runs added:

  DRS    the example's defaults with one padded training shape (`--num-shapes 1`): session 27's DR, faster
  DRK    DRS + `--kd-weight 1`: the candidate default
  DRKE   DRK + `--ema-decay 0.999`: an average of the weights over ~1,000 steps on top
  DRK1   DRK + `--seed 1`

Env: session 25's (SCREEN, default DRK; STEPS, EVERY, WORKERS, DEADLINE or /root/ex/deadline, FINAL).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "2026-12-05-session25"))
os.environ.setdefault("SCREEN", "DRK")
os.environ.setdefault("STEPS", "20000")
import screen as s25  # noqa: E402

DRS = s25.RUNS["DR"] + ["--num-shapes", "1"]
s25.RUNS.update({"DRS": DRS, "DRK": DRS + ["--kd-weight", "1"], "DRKE": DRS + ["--kd-weight", "1", "--ema-decay", "0.999"],
                 "DRK1": DRS + ["--kd-weight", "1", "--seed", "1"]})

if __name__ == "__main__":
    s25.lg.guarded(s25.main)
