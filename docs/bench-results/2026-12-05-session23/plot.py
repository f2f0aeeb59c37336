"""Session 23's long run: held-out and online tau against minutes of the H200 alone, beside session 21's.

    python docs/bench-results/2026-12-05-session23/plot.py OUT.png

Minutes are the run's own step times summed (ctx_tokens / ctx_tokens_per_s per step, held-out evals
included), read from each session's committed metrics; the online points are the evals in the results.
"""

from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent


def member(tar: Path, name: str) -> list[dict]:
    with tarfile.open(tar) as t:
        f = t.extractfile(name)
        return [json.loads(x) for x in io.TextIOWrapper(f, encoding="utf-8") if x.strip()]


def curve(rows: list[dict]) -> tuple[dict, list, list]:
    minutes, t, held = {}, 0.0, ([], [])
    for r in rows:
        if r.get("ctx_tokens_per_s"):
            t += r["ctx_tokens"] / r["ctx_tokens_per_s"] / 60
        minutes[r["step"]] = t
        if "eval_tau" in r:
            held[0].append(t)
            held[1].append(r["eval_tau"])
    return minutes, *held


def main() -> None:
    out = Path(sys.argv[1])
    s23 = member(HERE / "results/detail.tar.xz", "./metrics/DT.jsonl")
    m23, x23, y23 = curve(s23)
    s21 = member(HERE.parent / "2026-12-04-session21/results/detail.tar.xz", "./metrics/DT.jsonl")
    m21, x21, y21 = curve(s21)
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(x23, y23, "o-", color="tab:blue", label="held-out tau, session 23 (21,500-step cosine)")
    ax.plot([m23[21000]], [2.857], "s", color="tab:blue", ms=9, label="online tau 2.857 at 21,000 (s23)")
    ax.plot(x21, y21, ".--", color="tab:gray", label="held-out tau, session 21 (5,000-step cosine; minutes partly shared)")
    ax.plot([m21[5000]], [2.262], "s", color="tab:gray", ms=9, label="online tau 2.262 at 5,000 (s21)")
    ax.axhline(3.0, color="tab:red", lw=0.8, ls=":", label="the aim: online 3.0")
    ax.set_xlabel("minutes of training (step times summed)")
    ax.set_ylabel("tau (block 16)")
    ax.set_title("SmolLM2-135M on ShareGPT, the example's defaults, one H200")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}: s23 {m23[max(m23)]:.2f} min for {max(m23)} steps")


if __name__ == "__main__":
    main()
