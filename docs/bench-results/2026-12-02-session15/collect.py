"""Summarise session 15's runs and evals as one JSON: per run its last logged step, loss, training tau,
host wall time, and every online eval of its checkpoints (step, tau, lossless)."""
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
        rows = [x for x in rows if "tau" in x]
        if rows:
            last = rows[-1]
            step_s = sum(x["ctx_tokens"] / x["ctx_tokens_per_s"] for x in rows if x.get("ctx_tokens_per_s"))
            rec.update(step=last.get("step"), loss=last.get("loss"), tau=last.get("tau"), step_wall_s=round(step_s, 1),
                       tau_last50=sum(x["tau"] for x in rows[-50:]) / len(rows[-50:]))
    rec["evals"] = {}
    for e in sorted(evals.glob(f"{r.name}@*.json")):
        ev = json.loads(e.read_text())
        on = ev.get("online", {})
        rec["evals"][e.stem.split("@", 1)[1]] = {"checkpoint": Path(ev.get("checkpoint", "")).name, "tau": on.get("tau"),
                                                 "lossless": ev.get("lossless"), "prompts": on.get("num_prompts"),
                                                 "speedup": on.get("speedup"), "reference": on.get("reference")}
    out[r.name] = rec
print(json.dumps(out, indent=1))
