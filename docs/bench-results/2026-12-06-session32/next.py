"""Session 32's plan for the next lease: are the target's own sampled replies more data? (4K.gen, fast now)

On all 17K conversations the defaults plateau at 2.97-2.98 online, KD included (session 32); 4K
conversations plateau near 2.0 (session 30): the data is the lever.  The one source of more text this
package leaves is the target's own sampled replies, and `dflash generate` now decodes a small target
3.7x faster with `--static-cache on` (session 32), so session 29's 4K.gen fits a lease beside its
baseline.  Session 29's screen driver (its docstring says what each run and store is) with:

  4K       the example's defaults with one padded shape, on the first 4,000 conversations: this lease's
           baseline (session 30's ran beside three other runs; steps compare, minutes do not)
  4K.gen   the same on `stores/4kgen`: those conversations and SAMPLES replies of the target's own to each
           one's first exchange, sampled at temperature 0.8, at most GEN_TOKENS tokens
  4K.ema   4K + `--ema-decay 0.999` (the weights averaged over ~1,000 steps; unmeasured on the GPU)

Defaults set here (env wins): SCREEN=4K,4K.gen,4K.ema STEPS=4000 EVERY=1000 SAMPLES=2 GEN_TOKENS=256,
GEN_GPUS=0 (one generate process, also for the online prompts' replies), GEN_BATCH_4K=64 and
GEN_EXTRA="--static-cache on" (64 rows: the replies are generated while `stores/4k` is captured, which
takes ~49 GB of the GPU at precompute's token budget; sessions 15 and 30 ran out of memory there).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
for k, v in {"SCREEN": "4K,4K.gen,4K.ema", "STEPS": "4000", "EVERY": "1000", "SAMPLES": "2", "GEN_TOKENS": "256",
             "GEN_GPUS": "0", "GEN_BATCH_4K": "64", "GEN_EXTRA": "--static-cache on"}.items():
    os.environ.setdefault(k, v)
# session 29's driver is a module named `screen` that imports session 25's `screen`: load it under its own name
_spec = importlib.util.spec_from_file_location("screen29", HERE.parent / "2026-12-06-session29/screen.py")
s29 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(s29)

s29.s25.RUNS["4K.ema"] = s29.BASE + ["--ema-decay", "0.999"]
s29.s25.STORE["4K.ema"] = "4k"

if __name__ == "__main__":
    s29.lg.guarded(s29.main)
