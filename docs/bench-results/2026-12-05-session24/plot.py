"""Session 24's run: held-out tau, walk tau and lossless online tau against minutes of one GPU alone (an H100 in session 25).

    python docs/bench-results/2026-12-05-session24/plot.py OUT.png > results/curve.json

Minutes are the run's own step times summed (ctx_tokens / ctx_tokens_per_s per step, held-out evals and
walks included), from its metrics; the walks on the online prompts and the lossless eval are the JSON
files the driver wrote (results/detail.tar.xz).
"""

from __future__ import annotations

import io
import json
import os
import re
import sys
import tarfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "2026-12-05-session23"))
from plot import curve, member  # noqa: E402

RUN = os.environ.get("RUN", "DT")  # the run to plot (RUN=DR for session 26's plan)


def evals(tar: Path) -> tuple[dict, dict]:
    """({step: lossless online tau}, {step: walk tau on online_gen}) from the driver's eval JSONs."""
    online, walk = {}, {}
    with tarfile.open(tar) as t:
        for m in t.getmembers():
            hit = re.search(rf"(walk_)?{RUN}@step-(\d+)\.json$", m.name)
            if not hit:
                continue
            d = json.load(io.TextIOWrapper(t.extractfile(m), encoding="utf-8"))
            step = int(hit.group(2))
            if hit.group(1):
                walk[step] = d["offline"]["walk"]["tau"]
            elif "online" in d:
                online[step] = d["online"]["tau"]
    return online, walk


def main() -> None:
    out = Path(sys.argv[1])
    tar = Path(sys.argv[2]) if len(sys.argv) > 2 else HERE / "results/detail.tar.xz"
    rows = member(tar, f"./metrics/{RUN}.jsonl")
    minutes, xh, yh = curve(rows)
    wx = [(minutes[r["step"]], r["eval_walk_tau"]) for r in rows if "eval_walk_tau" in r]
    online, walk = evals(tar)
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(xh, yh, "o-", color="tab:gray", label="held-out tau, random anchors (heldout_gen)")
    if wx:
        ax.plot(*zip(*wx), "o-", color="tab:blue", label="walk tau on heldout_gen (first exchanges), in training")
    if walk:
        ax.plot([minutes[s] for s in sorted(walk)], [walk[s] for s in sorted(walk)], "^-", color="tab:green",
                label="walk tau on the online prompts' own replies")
    for s, t in online.items():
        ax.plot([minutes[s]], [t], "s", color="tab:red", ms=9, label=f"lossless online tau {t:.3f} at {s:,}")
    ax.axhline(3.0, color="tab:red", lw=0.8, ls=":", label="the aim: online 3.0")
    ax.set_xlabel("minutes of training alone (step times summed)")
    ax.set_ylabel("tau (block 16)")
    ax.set_title(os.environ.get("TITLE", "SmolLM2-135M on ShareGPT, the example's defaults, one H100 (session 25)"))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(json.dumps({"minutes_total": round(minutes[max(minutes)], 2), "steps": max(minutes),
                      "heldout": dict(zip([r["step"] for r in rows if "eval_tau" in r], yh)),
                      "walk_heldout_gen": {r["step"]: r["eval_walk_tau"] for r in rows if "eval_walk_tau" in r},
                      "walk_online_gen": walk, "online": online,
                      "minutes_at": {s: round(minutes[s], 2) for s in sorted(set(walk) | set(online))}}, indent=1))


if __name__ == "__main__":
    main()
