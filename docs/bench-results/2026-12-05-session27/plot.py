"""Session 27's long run: the example's defaults (rollout labels) alone on one H100 for 21,500 steps,
online tau (the walk over the online prompts' own replies) against steps and against minutes alone,
beside session 26's screen (rollout against target labels, 12,000-step cosines) and session 23's
`--labels target` run (its lossless online point).

    python docs/bench-results/2026-12-05-session27/plot.py OUT.png > results/curve.json
    RUN=D5RS TAR=later/detail.tar.xz python docs/bench-results/2026-12-05-session27/plot.py OUT.png

With RUN and TAR, a later run's metrics (whole: every step's time) are drawn too, against the same axes
(LABEL names it in the legend, TITLE replaces the title).

Minutes alone are the run's step times summed (ctx_tokens / ctx_tokens_per_s per step; compilation and
the in-training evals fall inside the step after them), stored as `minutes_alone` in the thinned metrics
of results/detail.tar.xz. "Training only" subtracts each eval's own `eval_s + eval_walk_s`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "2026-12-05-session23"))
from plot import curve, member  # noqa: E402


def later_run(a1, a2) -> dict:
    """RUN's walk against steps and minutes (its step times summed) from TAR, drawn beside DR's."""
    run, tar = os.environ.get("RUN"), os.environ.get("TAR")
    if not (run and tar):
        return {}
    rows = member(Path(tar), f"./metrics/{run}.jsonl")
    minutes = curve(rows)[0]
    ev = [r for r in rows if "eval_walk_tau" in r]
    steps, walk = [r["step"] for r in ev], [r["eval_walk_tau"] for r in ev]
    label = os.environ.get("LABEL", run)
    a1.plot(steps, walk, "D-", color="tab:blue", label=label)
    a2.plot([minutes[s] for s in steps], walk, "D-", color="tab:blue", label=f"{label}, minutes alone")
    return {run: {"walk": dict(zip(steps, [round(w, 4) for w in walk])),
                  "minutes_alone_at": {s: round(minutes[s], 2) for s in steps}}}


def main() -> None:
    out = Path(sys.argv[1])
    rows = [r for r in member(HERE / "results/detail.tar.xz", "./metrics/DR.jsonl") if "eval_walk_tau" in r]
    steps = [r["step"] for r in rows]
    walk = [r["eval_walk_tau"] for r in rows]
    mins = [r["minutes_alone"] for r in rows]
    spent, train_only = 0.0, []
    for r in rows:  # an eval's cost is charged to the step after it: subtract the evals before this row's
        train_only.append(r["minutes_alone"] - spent)
        spent += (r["eval_s"] + r["eval_walk_s"]) / 60
    s26 = json.loads((HERE.parent / "2026-12-05-session26/results/curve.json").read_text())
    s23 = member(HERE.parent / "2026-12-05-session23/results/detail.tar.xz", "./metrics/DT.jsonl")
    m23 = curve(s23)[0]

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 5), sharey=True)
    a1.plot(steps, walk, "o-", color="tab:red", label="s27: the example's defaults (rollout), 21,500-step cosine")
    for name, color in (("DR", "tab:orange"), ("DT", "tab:gray")):
        w = s26[name]["walk"]
        a1.plot([int(s) for s in w], list(w.values()), ".--", color=color,
                label=f"s26 {name} ({'rollout' if name == 'DR' else 'target'} labels), 12,000-step cosine, shared")
    a1.plot([21000], [2.857], "s", color="tab:gray", ms=8, label="s23 --labels target: lossless online 2.857")
    a2.plot(mins, walk, "o-", color="tab:red", label="s27, minutes alone (evals and compilation included)")
    a2.plot(train_only, walk, "^:", color="tab:red", alpha=0.6, label="s27, training only (evals taken out)")
    a2.plot([m23[21000]], [2.857], "s", color="tab:gray", ms=8, label="s23 --labels target, an H200 alone")
    a2.axvline(20, color="k", lw=0.8, ls=":")
    later = later_run(a1, a2)
    for ax in (a1, a2):
        ax.axhline(3.0, color="tab:red", lw=0.8, ls=":", label="the aim: online 3.0")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    a1.set_xlabel("step")
    a2.set_xlabel("minutes of one H100 alone (step times summed)")
    a1.set_ylabel("online tau: the walk over the online prompts' own replies (block 16)")
    fig.suptitle(os.environ.get("TITLE", "SmolLM2-135M on ShareGPT: the example's defaults alone for 21,500 steps "
                                         "(session 27)"))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(json.dumps({"walk": dict(zip(steps, [round(w, 4) for w in walk])),
                      "minutes_alone_at": dict(zip(steps, [round(m, 2) for m in mins])),
                      "training_only_minutes_at": dict(zip(steps, [round(m, 2) for m in train_only])),
                      "random_anchors_online_gen": {r["step"]: round(r["eval_tau"], 4) for r in rows},
                      "eval_s": {r["step"]: round(r["eval_s"], 1) for r in rows},
                      "eval_walk_s": {r["step"]: round(r["eval_walk_s"], 1) for r in rows},
                      "s23_target_labels_online_at_21000": {"tau": 2.857, "minutes_alone": round(m23[21000], 2)},
                      **later},
                     indent=1))


if __name__ == "__main__":
    main()
