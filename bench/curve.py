"""Held-out tau (and the training batches' tau) of a run against training time, from its metrics.jsonl.

    python bench/curve.py runs/default benchmarks/embedded-default-heldout-tau-cpu-2026-12-01.png

Time is the sum of the steps' intervals (ctx tokens / ctx tokens per second), so set-up, evaluation and
checkpoint writes are left out: the drafter's training time alone.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(run: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().split("\n") if line.strip()]
    t, clock = [], 0.0
    for r in recs:
        clock += r["ctx_tokens"] / r["ctx_tokens_per_s"] if r["ctx_tokens_per_s"] else 0.0
        t.append(clock / 60)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(t, [r["tau"] for r in recs], lw=0.6, alpha=0.5, label="training batches (tau per step)")
    held = [(ti, r["eval_tau"]) for ti, r in zip(t, recs) if "eval_tau" in r]
    if held:
        ax.plot(*zip(*held), "-o", ms=4, color="C3", label="held-out store (--eval-every)")
    ax.set_xlabel("training time (minutes)")
    ax.set_ylabel("acceptance length tau")
    ax.set_title(f"{run}: {recs[-1]['step']} steps")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}; held-out tau {[round(v, 3) for _, v in held]}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
