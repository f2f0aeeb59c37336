"""Session 16's screen on the real target: held-out tau against steps, and against fair-share GPU-minutes.

    python3 plot.py lease2/detail.tar.xz ../../real_screen_session16.png

Fair share: the nine screen runs (ten once gen_r8 started) shared one H200 from start to end, so a run's
GPU-minutes at step k are its own wall seconds to step k (the sum of its steps' times, from metrics.jsonl)
over the number of runs alive then (gpu.log's second column, sampled every 5 s).  This is not what the
run would take alone (the runs waited on their one data worker and the 16 host cores, data_wait_frac
~0.9 in their metrics), so it compares the runs with one another, not with a run alone.
"""

import json
import sys
import tarfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

src, out = Path(sys.argv[1]), Path(sys.argv[2])
gpu = [line.split() for line in (src.parent / "gpu.log").read_text().splitlines() if line.strip()]
alive = [(float(g[0]), int(g[1])) for g in gpu]
t0 = alive[0][0]


def sharers(t):  # runs alive at t seconds after the screen started
    best = alive[0][1]
    for ts, n in alive:
        if ts - t0 <= t:
            best = n
    return max(best, 1)


runs = {}
with tarfile.open(src) as tar:
    for m in tar.getmembers():
        if m.name.startswith("metrics/runs_") and m.isfile():
            rows = [json.loads(x) for x in tar.extractfile(m).read().decode().split("\n") if x.strip()]
            runs[m.name[len("metrics/runs_"):-len(".jsonl")]] = rows
fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
start = {"gen_r8": 359.0}  # gen_r8 started 359 s after the others (study.log: 16:00:40 -> 16:06:39)
for name, rows in sorted(runs.items()):
    wall, gpu_min, pts = start.get(name, 0.0), 0.0, []
    for r in rows:
        if r.get("ctx_tokens_per_s"):
            dt = r["ctx_tokens"] / r["ctx_tokens_per_s"]
            gpu_min += dt / sharers(wall) / 60
            wall += dt
        if "eval_tau" in r:
            pts.append((r["step"], gpu_min, r["eval_tau"]))
    if pts:
        s, g, t = zip(*pts)
        a.plot(s, t, marker="o", label=name)
        b.plot(g, t, marker="o", label=name)
a.set_xlabel("step (8 packed rows of 4,096 tokens, ~16 samples)")
b.set_xlabel("fair-share H200-minutes (wall / runs sharing the GPU)")
for ax in (a, b):
    ax.set_ylabel("held-out tau (offline, 196 ShareGPT samples)")
    ax.grid(alpha=0.3)
a.legend(fontsize=8)
fig.suptitle("SmolLM2-135M-Instruct on ShareGPT (4K conversations), block 16, one H200, 2026-12-02")
fig.tight_layout()
fig.savefig(out, dpi=110)
print(out)
