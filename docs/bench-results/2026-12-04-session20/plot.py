"""Session 20's plot from the last watch call's results (results/study.json):

    python3 docs/bench-results/2026-12-04-session20/plot.py docs/bench-results/2026-12-04-session20/results docs/real_study_session20.png

Held-out tau (offline, on the store of the target's own replies to the held-out first exchanges) of every
run, left against its fair-share GPU-minutes (study.py fair_share_minutes: the wall time it trained over
the number of training runs alive), right against its optimizer steps.  Stars: online tau (the lossless
eval, 100 held-out prompts x 128 new tokens) of each checkpoint whose eval finished.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LABELS = {"L": "L: DFlash (the CLI's defaults)", "T": "T: DFlash, --labels target",
          "D": "D: DFlash2 + D-PACE", "DT": "DT: DFlash2 + D-PACE, --labels target",
          "S": "S: DSpark, TV on the stored top-k"}


def minutes(at: list, step: int) -> float:
    """Fair-share GPU-minutes when the run first reached `step` (its progress samples: (step, minutes))."""
    return next((m for s, m in at if s >= step), at[-1][1])


def main(src: Path, out: Path) -> None:
    study = json.loads((src / "study.json").read_text())
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5))
    for name, rec in study["runs"].items():
        at, held = rec.get("fair_share") or [], rec.get("heldout") or []
        if not at or not held:
            continue
        taus = [h["eval_tau"] for h in held]
        line, = a.plot([minutes(at, h["step"]) for h in held], taus, "o-", ms=3, label=LABELS.get(name, name))
        b.plot([h["step"] for h in held], taus, "o-", ms=3, color=line.get_color(), label=LABELS.get(name, name))
        for key, ev in study["evals"].items():
            run, _, ck = key.partition("@")
            if run == name and ev.get("tau"):
                step = int(ck.split("-")[1])
                a.plot([minutes(at, step)], [ev["tau"]], "*", ms=13, color=line.get_color())
                b.plot([step], [ev["tau"]], "*", ms=13, color=line.get_color())
    a.set(xlabel="GPU-minutes (fair share of one H200 among the five training runs)", ylabel="tau")
    b.set(xlabel="optimizer steps (8 packed rows of 4,096 tokens, ~20 ShareGPT samples)", ylabel="tau")
    fig.suptitle("SmolLM2-135M-Instruct on all 17K ShareGPT conversations, block 16: held-out tau (lines) "
                 "and online tau (stars)", fontsize=11)
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
