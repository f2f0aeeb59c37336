"""Session 30's 4K screen: online tau by the walk against steps, one line a run (results/curve.json)."""
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
curve = json.loads((HERE / "results/curve.json").read_text())
# Session 26's DR (3 layers, rollout labels, all 17K conversations, a 12,000-step cosine, shared GPU).
DR17K = {2000: 1.984, 4000: 2.282, 6000: 2.508, 8000: 2.662, 10000: 2.763, 12000: 2.802}
fig, ax = plt.subplots(figsize=(7, 4.2))
for run, c in curve.items():
    pts = sorted((int(s), t) for s, t in c["walk"].items())
    ax.plot(*zip(*pts), marker="o", label=f"{run} (4K conversations, 4,000-step cosine)")
ax.plot(*zip(*sorted(DR17K.items())), "k--", marker="s", label="s26 DR (17K conversations, 12,000-step cosine)")
ax.axhline(2.98, color="grey", lw=0.8, ls=":")
ax.text(200, 2.93, "the defaults' plateau on 17K (s27)", fontsize=8, color="grey")
ax.set_xlabel("step")
ax.set_ylabel("online tau (the walk, 100 held-out prompts, 128 tokens)")
ax.set_title("Session 30, H100: 4K conversations, four runs sharing the GPU")
ax.grid(alpha=0.3)
ax.legend(fontsize=7, loc="lower right")
fig.tight_layout()
fig.savefig(sys.argv[1] if len(sys.argv) > 1 else "docs/real_study_session30.png", dpi=110)
