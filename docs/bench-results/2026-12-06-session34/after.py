"""Session 34's plan for the lease after `next.py`'s: the defaults on all 17K conversations and 34K sampled replies, alone.

Two sampled replies of the target a conversation lifted the defaults' plateau on the first 4,000
conversations by 0.09 and 0.13 online (session 34).  Whether that carries to all 17K conversations is the
measure that decides the example's data: session 32's run of the defaults (with KD, level with them)
read 2.985 by the walk and 2.970 lossless at step 20,000 of a 20,000-step cosine, 13.4 minutes alone.

  DRG    the example's defaults with one padded shape (session 30's DRS) on `stores/allgen`: the 17,129
         training conversations and every carried sampled reply (REPLIES: session 33's 7,984 for the first
         4,000 and `next.py`'s gen_17k for the rest), in one fp8 store (~32M tokens, ~54 GiB)
  DRS    the same on `stores/all` (not in the default SCREEN: session 32's DRK stands for it)

Session 25's driver (the target, the online prompts' replies and `stores/online_gen`, the runs of SCREEN,
the walk every EVERY steps, then FINAL's lossless eval), with its stores replaced: `allgen` only, no
`heldout_gen` (the walk on `online_gen` is the measure, and the disk holds one store this size).

Env: session 25's (SCREEN default DRG, STEPS default 20000, EVERY default 2000, WORKERS, DEADLINE or
/root/ex/deadline, FINAL default DRG, FINAL_BY), REPLIES (colon-separated .jsonl.xz files; default
session 33's gen_4k, every `*/results/gen_17k*.jsonl.xz` beside this folder, and CARRY_DIR's
`gen_17k*.jsonl.xz`, where session 35's travels), KEEP (checkpoints kept, default 2: session 36).
"""

from __future__ import annotations

import lzma
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "2026-12-05-session25"))
for k, v in {"SCREEN": "DRG", "STEPS": "20000", "EVERY": "2000", "FINAL": "DRG"}.items():
    os.environ.setdefault(k, v)
import screen as s25  # noqa: E402

s = s25.s
DRS = s25.RUNS["DR"] + ["--num-shapes", "1"]
s25.RUNS.update({"DRG": DRS, "DRS": DRS})
s25.STORE.update({"DRG": "allgen"})
# Session 36: keep 2 checkpoints (KEEP). Each is 449 MB with its AdamW moments, and ten beside the 56.9 GiB store
# would leave ~2 GiB of the 64 free; the walk runs inside training and the eval reads only the last one.
s.COMMON[s.COMMON.index("--keep-checkpoints") + 1] = os.environ.get("KEEP", "2")
# gen_17k (9.3 MB) is not in git since session 35: it travels in CARRY_DIR (.carry, joined under /root/big)
_carried = Path(os.environ["CARRY_DIR"]) if os.environ.get("CARRY_DIR") else None
_default = [HERE.parent / "2026-12-06-session33/results/gen_4k.jsonl.xz", *sorted(HERE.parent.glob("*/results/gen_17k*.jsonl.xz")),
            *(sorted(_carried.glob("gen_17k*.jsonl.xz")) if _carried else [])]
REPLIES = [Path(p) for p in os.environ.get("REPLIES", ":".join(map(str, _default))).split(":") if p]


def stores() -> bool:
    """`stores/allgen` (and `stores/all` if a run reads it), one at a time: each precompute takes most of
    the GPU's memory at its token budget."""
    wanted = {s25.STORE.get(n, "all") for n in s25.NAMES}
    if "allgen" in wanted:
        data = s.E / "data/train_allgen.jsonl"
        with open(data, "wb") as out:
            out.write((s.E / "data/train.jsonl").read_bytes())
            for p in REPLIES:
                with lzma.open(p) as f:
                    replies = f.read()
                out.write(replies)
                n = replies.count(b"\n")
                s.log(f"replies: {n} from {p}")
        if s.run("precompute_allgen", s.DF + ["precompute", "--data", str(data.relative_to(s.E)), "--out",
                                              "stores/allgen"] + s.ALL_ARGS, 900):
            return False
    if "all" in wanted and s.run("precompute_all", s.DF + ["precompute", "--data", "data/train.jsonl", "--out",
                                                           "stores/all"] + s.ALL_ARGS, 600):
        return False
    return True


s25.lg.stores = stores

if __name__ == "__main__":
    s25.lg.guarded(s25.main)
