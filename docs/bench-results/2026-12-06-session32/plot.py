"""Session 32's long run: DRK (the example's defaults + one padded shape + KD on the stored top-k) alone on
an H100 for a 20,000-step cosine, online tau by the walk against steps and minutes alone, beside session
27's DR (the example's defaults, a 21,500-step cosine, alone on an H100).

    python docs/bench-results/2026-12-06-session32/plot.py docs/real_study_session32.png > results/curve.json
"""
import json
import lzma
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
rows = [json.loads(x) for x in lzma.open(HERE / "results/metrics_sampled.jsonl.xz", "rt") if x.strip()]
ev = [r for r in rows if "eval_walk_tau" in r]
s27 = json.loads((HERE.parent / "2026-12-05-session27/results/curve.json").read_text())
online = json.loads((HERE / "results/eval_DRK_step-00020000.json").read_text())["tau"]

fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 5), sharey=True)
steps, walk, mins = [r["step"] for r in ev], [r["eval_walk_tau"] for r in ev], [r["minutes_alone"] for r in ev]
a1.plot(steps, walk, "D-", color="tab:blue", label="s32 DRK: + one shape + KD, 20,000-step cosine")
a2.plot(mins, walk, "D-", color="tab:blue", label="s32 DRK, minutes alone (evals, compilation included)")
w27 = {int(k): v for k, v in s27["walk"].items()}
m27 = {int(k): v for k, v in s27["minutes_alone_at"].items()}
a1.plot(list(w27), list(w27.values()), "o--", color="tab:red", label="s27 DR: the defaults, 21,500-step cosine")
a2.plot([m27[s] for s in w27], list(w27.values()), "o--", color="tab:red", label="s27 DR, minutes alone")
for ax, x in ((a1, 20000), (a2, mins[-1])):
    ax.plot([x], [online], "s", color="tab:blue", ms=8, label=f"s32 DRK lossless online eval: {online:.3f}")
    ax.axhline(3.0, color="k", lw=0.8, ls=":", label="the aim: online 3.0")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
a2.axvline(20, color="k", lw=0.8, ls=":")
a1.set_xlabel("step")
a2.set_xlabel("minutes of one H100 alone (step times summed)")
a1.set_ylabel("online tau: the walk over the online prompts' own replies (block 16)")
fig.suptitle("SmolLM2-135M on ShareGPT, all 17K conversations: KD at length (session 32)")
fig.tight_layout()
fig.savefig(sys.argv[1], dpi=110)
print(json.dumps({"DRK": {"walk": dict(zip(steps, [round(w, 4) for w in walk])),
                          "minutes_alone_at": dict(zip(steps, [round(m, 2) for m in mins])),
                          "held_out_random_anchors": {r["step"]: round(r["eval_tau"], 4) for r in ev},
                          "lossless_online_at_20000": round(online, 4)}}, indent=1))
