"""Session 21's plot (results/study.json), with session 20's five runs for comparison:

    python3 docs/bench-results/2026-12-04-session21/plot.py docs/bench-results/2026-12-04-session21/results \
        docs/bench-results/2026-12-04-session20/results docs/real_study_session21.png

Held-out tau (offline, on the store of the target's own replies to the held-out first exchanges), left
against GPU-minutes (study.py fair_share_minutes: the wall time a run trained over the number of training
runs alive), right against optimizer steps. Solid: session 21 (the example's defaults in one long run, and
DSpark again; DT's steps 3,000-5,000 ran in a later call, resumed from its checkpoint); dotted: session 20's runs. Stars: online tau (the lossless eval, 100 held-out prompts x 128
new tokens) of each checkpoint whose eval finished.
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

LABELS = {"L": "DFlash (the CLI's defaults)", "T": "DFlash, --labels target", "D": "DFlash2 + D-PACE",
          "DT": "DFlash2 + D-PACE, --labels target (the example's defaults)", "S": "DSpark, TV on the stored top-k"}


def minutes(at: list, step: int) -> float:
    """GPU-minutes when the run first reached `step` (its progress samples: (step, minutes))."""
    return next((m for s, m in at if s >= step), at[-1][1])


def draw(study: dict, a, b, session: str, style: str, colors: dict) -> None:
    for name, rec in study["runs"].items():
        at, held = rec.get("fair_share") or [], rec.get("heldout") or []
        if not at or not held:
            continue
        taus = [h["eval_tau"] for h in held]
        kw = dict(ms=3, label=f"{session} {name}: {LABELS.get(name, name)}", color=colors.get(name))
        line, = a.plot([minutes(at, h["step"]) for h in held], taus, style, **kw)
        colors.setdefault(name, line.get_color())
        b.plot([h["step"] for h in held], taus, style, **kw)
        for key, ev in study["evals"].items():
            run, _, ck = key.partition("@")
            if run == name and ev.get("tau"):
                step = int(ck.split("-")[1])
                a.plot([minutes(at, step)], [ev["tau"]], "*", ms=13, color=colors[name])
                b.plot([step], [ev["tau"]], "*", ms=13, color=colors[name])


def add_resumed(study: dict, src: Path) -> None:
    """The resumed segment (results/resume.json) after the driver's: its GPU-minutes are the first segment's
    total (the steps redone after the stop included) plus its own wall time, alone on the GPU, spread over its
    steps by their device-timeline times from metrics.jsonl (the rest of its wall time is start-up)."""
    seg = json.loads((src / "resume.json").read_text())
    with tarfile.open(src / "detail.tar.xz") as t:
        raw = t.extractfile(f"./metrics/{seg['run']}.jsonl").read().decode()
    rows = [json.loads(x) for x in io.StringIO(raw) if x.strip()]
    rows = [r for r in rows if "tau" in r and r["step"] > seg["from_step"] and r.get("ctx_tokens_per_s")]
    times = [r["ctx_tokens"] / r["ctx_tokens_per_s"] for r in rows]
    start_up = seg["wall_s"] - sum(times)
    rec = study["runs"][seg["run"]]
    base, acc = rec["fair_share"][-1][1], start_up
    for r, dt in zip(rows, times):
        acc += dt
        rec["fair_share"].append((r["step"], base + acc / 60))


def main(src: Path, earlier: Path, out: Path) -> None:
    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 5.5))
    colors: dict = {}
    study = json.loads((src / "study.json").read_text())
    if (src / "resume.json").is_file():
        add_resumed(study, src)
    draw(study, a, b, "s21", "o-", colors)
    old = json.loads((earlier / "study.json").read_text())
    old["runs"] = {k: v for k, v in old["runs"].items() if k in ("L", "D", "DT", "S")}
    draw(old, a, b, "s20", "o:", colors)
    seg = json.loads((src / "resume.json").read_text()) if (src / "resume.json").is_file() else None
    if seg:  # DT's steps as minutes alone: the resumed segment's wall time per step, start-up and evals included
        per = seg["wall_s"] / (seg["to_step"] - seg["from_step"]) / 60
        top = b.secondary_xaxis("top", functions=(lambda x: x * per, lambda m: m / per))
        top.set_xlabel(f"DT alone on the H200: minutes at the resumed segment's {per * 60:.3f} s per step", fontsize=8)
    a.set(xlabel="GPU-minutes (wall time over the training runs alive on one H200; s21 DT: steps 3,000-5,000 "
                 "resumed alone)", ylabel="tau")
    b.set(xlabel="optimizer steps (8 packed rows of 4,096 tokens, ~20 ShareGPT samples)", ylabel="tau")
    fig.suptitle("SmolLM2-135M-Instruct on all 17K ShareGPT conversations, block 16: held-out tau (lines) and "
                 "online tau (stars)", fontsize=11)
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
