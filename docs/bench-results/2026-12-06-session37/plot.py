"""Session 37's long run: DRG (the example's defaults with one padded shape on all 17K conversations and the
target's 34K sampled replies, top-1 fp8 store) alone on an H100 for a 20,000-step cosine, online tau by the
walk against steps and minutes alone, beside session 32's DRK (the same without the replies, with KD) and
session 27's DR (the defaults, three shapes, a 21,500-step cosine), with each run's lossless online eval.

    python docs/bench-results/2026-12-06-session37/plot.py docs/real_study_session37.png > results/curve.json
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
online = json.loads((HERE / "results/eval_DRG_step-00020000.json").read_text())["online"]["tau"]
s32 = json.loads((HERE.parent / "2026-12-06-session32/results/curve.json").read_text())["DRK"]
s27 = json.loads((HERE.parent / "2026-12-05-session27/results/curve.json").read_text())


def ints(d: dict) -> dict:
    return {int(k): v for k, v in d.items()}


fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 5), sharey=True)
steps, walk, mins = [r["step"] for r in ev], [r["eval_walk_tau"] for r in ev], [r["minutes_alone"] for r in ev]
a1.plot(steps, walk, "D-", color="tab:green", label="s37 DRG: + the target's 34K sampled replies, one shape")
a2.plot(mins, walk, "D-", color="tab:green", label="s37 DRG, minutes alone (evals, compilation included)")
for name, c, run, lossless in (("s32 DRK: one shape + KD", "tab:blue", s32, s32["lossless_online_at_20000"]),
                               ("s27 DR: three shapes, 21,500-step cosine", "tab:red", s27, None)):
    w, m = ints(run["walk"]), ints(run["minutes_alone_at"])
    a1.plot(list(w), list(w.values()), "o--", color=c, label=name)
    a2.plot([m[s] for s in w], list(w.values()), "o--", color=c, label=f"{name.split(':')[0]}, minutes alone")
    if lossless:
        a1.plot([20000], [lossless], "s", color=c, ms=7)
        a2.plot([m[20000]], [lossless], "s", color=c, ms=7, label=f"s32 DRK lossless online: {lossless:.3f}")
for ax, x in ((a1, 20000), (a2, mins[-1])):
    ax.plot([x], [online], "s", color="tab:green", ms=8, label=f"s37 DRG lossless online eval: {online:.3f}")
    ax.axhline(3.0, color="k", lw=0.8, ls=":", label="the aim: online 3.0")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
a2.axvline(20, color="k", lw=0.8, ls=":")
a1.set_xlabel("step")
a2.set_xlabel("minutes of one H100 alone (step times summed)")
a1.set_ylabel("online tau: the walk over the online prompts' own replies (block 16)")
fig.suptitle("SmolLM2-135M on ShareGPT, all 17K conversations + the target's sampled replies (session 37)")
fig.tight_layout()
fig.savefig(sys.argv[1], dpi=110)
print(json.dumps({"DRG": {"walk": dict(zip(steps, [round(w, 4) for w in walk])),
                          "minutes_alone_at": dict(zip(steps, [round(m, 2) for m in mins])),
                          "held_out_random_anchors": {r["step"]: round(r["eval_tau"], 4) for r in ev},
                          "lossless_online_at_20000": round(online, 4)}}, indent=1))
