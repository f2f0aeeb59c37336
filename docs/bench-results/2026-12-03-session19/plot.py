"""Session 19's plot from a watch call's results (study.json, detail.tar.xz):

    python3 docs/bench-results/2026-12-03-session19/plot.py RESULTS_DIR OUT.png

Held-out tau (offline, on the store of the target's own replies to the held-out prompts) of every run,
left against its fair-share GPU-minutes (study.py fair_share_minutes: the wall time it trained over the
number of training runs alive), right against its optimizer steps.  Online tau, where an eval finished,
is a star at the run's last point.
"""

from __future__ import annotations

import json
import sys
import tarfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def minutes(at: list, step: int) -> float:
    """Fair-share GPU-minutes when the run first reached `step` (its progress samples: (step, minutes))."""
    return next((m for s, m in at if s >= step), at[-1][1])


def main(src: Path, out: Path) -> None:
    study = json.loads((src / "study.json").read_text())
    evals = study["evals"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5))
    for name, rec in sorted(study["runs"].items()):
        at, held = rec.get("fair_share") or [], rec.get("heldout") or []
        if not at or not held:
            continue
        taus = [h["eval_tau"] for h in held]
        line, = a.plot([minutes(at, h["step"]) for h in held], taus, "o-", ms=3, label=name)
        b.plot([h["step"] for h in held], taus, "o-", ms=3, color=line.get_color(), label=name)
        on = [v["tau"] for k, v in evals.items() if k.startswith(name + "@") and v.get("tau")]
        if on:
            a.plot([minutes(at, held[-1]["step"])], [on[-1]], "*", ms=12, color=line.get_color())
    a.set(xlabel="GPU-minutes (fair share of one H200 among the training runs)", ylabel="held-out tau")
    b.set(xlabel="optimizer steps (8 packed rows of 4,096 tokens)", ylabel="held-out tau")
    fig.suptitle("SmolLM2-135M-Instruct: held-out tau on the target's own replies (block 16; stars: online tau, 100 held-out prompts x 128 tokens)")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    src = Path(sys.argv[1])
    if (src / "detail.tar.xz").is_file() and not (src / "detail").is_dir():
        with tarfile.open(src / "detail.tar.xz") as t:
            t.extractall(src / "detail", filter="data")
    main(src, Path(sys.argv[2]))
