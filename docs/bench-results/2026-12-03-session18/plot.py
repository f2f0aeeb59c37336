"""Session 18's plots from a watch call's results (study.json and detail.tar.xz):

    python3 docs/bench-results/2026-12-03-session18/plot.py RESULTS_DIR OUT.png

Left: each screen run's held-out tau (offline, on the regenerated held-out store) against its fair-share
GPU-minutes (wall time over the training runs alive, study.py fair_share_minutes), its online tau (the
lossless eval) as a marker at its last step. Right: `long` against GPU-minutes alone (its steps times its
step time measured alone at the start), offline and online.
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
    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 5.5))
    for name, rec in sorted(study["runs"].items()):
        if name in ("ref",) or not rec.get("heldout"):
            continue
        at = rec.get("fair_share") or []
        if name == "long":
            unit = rec.get("solo_step_s") or 0
            xs = [h["step"] * unit / 60 for h in rec["heldout"]]
            b.plot(xs, [h["eval_tau"] for h in rec["heldout"]], "o-", label="long: offline (held-out store)")
            pts = sorted((int(k.split("@step-")[1]), v["tau"]) for k, v in evals.items()
                         if k.startswith("long@") and v.get("tau"))
            b.plot([s * unit / 60 for s, _ in pts], [t for _, t in pts], "s--", label="long: online (lossless eval)")
            continue
        if not at:
            continue

        xs = [minutes(at, h["step"]) for h in rec["heldout"]]
        line, = a.plot(xs, [h["eval_tau"] for h in rec["heldout"]], "-", label=name)
        on = [v["tau"] for k, v in evals.items() if k.startswith(name + "@") and v.get("tau")]
        if on:
            a.plot([xs[-1]], [on[-1]], "*", ms=12, color=line.get_color())
    a.set(xlabel="GPU-minutes (fair share of one H200)", ylabel="tau",
          title="screen: offline held-out tau (lines), online tau (stars)")
    a.legend(fontsize=7, ncol=2)
    b.set(xlabel="GPU-minutes alone (steps x step time alone)", ylabel="tau", title="long: the candidate defaults")
    b.legend(fontsize=8)
    for ax in (a, b):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    src = Path(sys.argv[1])
    if (src / "detail.tar.xz").is_file() and not (src / "detail").is_dir():
        with tarfile.open(src / "detail.tar.xz") as t:
            t.extractall(src / "detail", filter="data")
    main(src, Path(sys.argv[2]))
