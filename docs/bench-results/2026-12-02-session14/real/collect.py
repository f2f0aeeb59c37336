"""Summarise the study's run and eval directories as one JSON: per run, its last logged step, wall time,
loss and training tau, and the online eval (tau, speed-up, lossless) where one finished."""
import json
import sys
from pathlib import Path

runs, evals = Path(sys.argv[1]), Path(sys.argv[2])
out = {}
for r in sorted(p for p in runs.iterdir() if p.is_dir()):
    rec = {}
    m = r / "metrics.jsonl"
    if m.is_file():
        rows = [json.loads(x) for x in m.read_text().split("\n") if x.strip()]
        if rows:
            last = rows[-1]
            rec.update(step=last.get("step"), loss=last.get("loss"), tau=last.get("tau"),
                       elapsed_s=last.get("elapsed_s", last.get("time_s")),
                       keys=sorted(last)[:40])
    cks = sorted((r / "checkpoints").glob("*")) if (r / "checkpoints").is_dir() else []
    rec["last_checkpoint"] = cks[-1].name if cks else None
    e = evals / f"{r.name}.json"
    if e.is_file():
        ev = json.loads(e.read_text())
        on = ev.get("online", {})
        rec["online"] = {"tau": on.get("tau", ev.get("tau")), "speedup": on.get("speedup"), "lossless": ev.get("lossless"),
                         "prompts": on.get("num_prompts", on.get("prompts")), "step": ev.get("step")}
    out[r.name] = rec
print(json.dumps(out, indent=1))
