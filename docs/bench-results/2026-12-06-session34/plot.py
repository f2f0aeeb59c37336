"""Session 34's 4K screen: online tau by the walk against steps, one line a run (results/curve.json)."""
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
curve = json.loads((HERE / "results/curve.json").read_text())
LABEL = {"4K (s33)": "4K: ShareGPT's replies only (session 33)", "4K.gen": "4K.gen: + 2 sampled replies a conversation",
         "4K.gen.s1": "4K.gen.s1: the same, seed 1", "4K.gen1": "4K.gen1: + 1 sampled reply",
         "4K.len": "4K.len: cut at 4,096 tokens"}
fig, ax = plt.subplots(figsize=(7, 4.2))
for run, c in curve.items():
    pts = sorted((int(s), t) for s, t in c["walk"].items())
    ax.plot(*zip(*pts), marker="o", ls="--" if run.startswith("4K (") else "-", label=LABEL.get(run, run))
ax.set_xlabel("step (a 4,000-step cosine; ~3.1 fair-share H100-minutes each)")
ax.set_ylabel("online tau (the walk, 100 held-out prompts, 128 tokens)")
ax.set_title("Session 34, H100: 4K conversations and the target's sampled replies")
ax.grid(alpha=0.3)
ax.legend(fontsize=7, loc="lower right")
fig.tight_layout()
fig.savefig(sys.argv[1] if len(sys.argv) > 1 else "docs/real_study_session34.png", dpi=110)
