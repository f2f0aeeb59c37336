"""Session 26's screen: online tau (the walk over the online prompts' own replies) of DT, DR and D5 against
steps and against fair-share GPU-minutes, one H200.

    python docs/bench-results/2026-12-05-session26/plot.py OUT.png > results/curve.json

The runs trained at once; study.py collect's `fair_share` (in results/study.json: [step, minutes] every
~5 s, each run charged the wall time over the runs alive, its in-training evals included) gives the
minutes at each eval step; the tau values are the runs' `eval_walk_tau` metrics (results/detail.tar.xz).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "2026-12-05-session23"))
from plot import member  # noqa: E402

LABELS = {"DT": "DT: the example's defaults (--labels target)", "DR": "DR: --labels rollout",
          "D5": "D5: --num-layers 5"}
COLORS = {"DT": "tab:gray", "DR": "tab:red", "D5": "tab:blue"}


def minutes_at(fair_share: list, step: int) -> float:
    """Fair-share minutes when the run first logged a step >= `step` (its eval at `step` not yet done)."""
    return next((m for s, m in fair_share if s >= step), fair_share[-1][1])


def main() -> None:
    out = Path(sys.argv[1])
    study = json.loads((HERE / "results/study.json").read_text())
    tar = HERE / "results/detail.tar.xz"
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 5), sharey=True)
    summary = {}
    for name, run in study["runs"].items():
        rows = [r for r in member(tar, f"./metrics/{name}.jsonl") if "eval_walk_tau" in r]
        steps = [r["step"] for r in rows]
        walk = [r["eval_walk_tau"] for r in rows]
        mins = [minutes_at(run["fair_share"], s) for s in steps]
        a1.plot(steps, walk, "o-", color=COLORS[name], label=LABELS[name])
        a2.plot(mins, walk, "o-", color=COLORS[name], label=LABELS[name])
        summary[name] = {"last_step": run["step"], "shared_step_s": round(run["shared_step_s"], 4),
                         "fair_share_minutes": run["fair_share_minutes"],
                         "walk": {s: round(w, 4) for s, w in zip(steps, walk)},
                         "minutes_at": {s: m for s, m in zip(steps, mins)},
                         "heldout_random_anchors": {r["step"]: round(r["eval_tau"], 4) for r in rows}}
    for ax in (a1, a2):
        ax.axhline(3.0, color="tab:red", lw=0.8, ls=":", label="the aim: online 3.0")
        ax.grid(alpha=0.3)
    a1.set_xlabel("step (each run a 12,000-step cosine; DT and D5 stopped at the window's end)")
    a2.set_xlabel("fair-share GPU-minutes (three runs at once on one H200)")
    a1.set_ylabel("online tau: the walk over the online prompts' own replies (block 16)")
    a1.legend(fontsize=8, loc="lower right")
    fig.suptitle("SmolLM2-135M on ShareGPT: rollout labels and 5 layers against the example's defaults (session 26)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
