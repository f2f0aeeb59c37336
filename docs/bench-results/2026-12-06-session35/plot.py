"""Session 35's 4K screen beside session 34's: online tau by the walk against steps (results/curve.json)."""
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
curve = json.loads((HERE / "results/curve.json").read_text())
LABEL = {"4K (s33)": "4K: ShareGPT's replies, block 16 (session 33)",
         "4K.gen (s34)": "4K.gen: + 2 sampled replies, 4,000-step cosine (s34)",
         "4K.gen.s1 (s34)": "4K.gen.s1: the same, seed 1 (s34)",
         "4K.b8": "4K.b8: block 8 (session 35)",
         "4K.gen.6k": "4K.gen.6k: + 2 sampled replies, 6,000-step cosine (s35)"}
fig, ax = plt.subplots(figsize=(7, 4.2))
for run, c in curve.items():
    pts = sorted((int(s), t) for s, t in c["walk"].items())
    ax.plot(*zip(*pts), marker="o", ls="--" if "(s3" in run else "-", label=LABEL.get(run, run))
ax.set_xlabel("step (cosines of 4,000 steps, 4K.gen.6k's of 6,000)")
ax.set_ylabel("online tau (the walk, 100 held-out prompts, 128 tokens)")
ax.set_title("Session 35, H100: more steps for more data; block 8")
ax.grid(alpha=0.3)
ax.legend(fontsize=7, loc="lower right")
fig.tight_layout()
fig.savefig(sys.argv[1] if len(sys.argv) > 1 else "docs/real_study_session35.png", dpi=110)
