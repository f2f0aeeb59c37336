"""One A/B run's step times from its metrics.jsonl: the median steady step, and each epoch boundary's
first step against its epoch's median (bench/epoch_restart.py's reading)."""

import json
import statistics
import sys

rows = [json.loads(x) for x in open(sys.argv[1]) if x.strip()]
dt = [r["ctx_tokens"] / r["ctx_tokens_per_s"] for r in rows]
steady = [d for r, d in zip(rows, dt) if r["step"] > 100 and d < 5]
by_epoch = {}
for r, d in zip(rows, dt):
    by_epoch.setdefault(r["epoch"], []).append(d)
excess = [v[0] - statistics.median(v[1:]) for e, v in sorted(by_epoch.items()) if e > min(by_epoch) and len(v) > 2]
host = {k: statistics.median(r[f"host_{k}_frac"] for r in rows[100:]) for k in ("fwd", "loss", "bwd", "opt", "sync")}
print(json.dumps({"steps": len(rows), "median_step_s": round(statistics.median(steady), 5),
                  "mean_step_s": round(statistics.mean(steady), 5), "epochs": len(by_epoch),
                  "boundary_excess_s": [round(x, 3) for x in excess],
                  "data_wait_frac_median": round(statistics.median(r["data_wait_frac"] for r in rows[100:]), 5),
                  "host_frac_median": {k: round(v, 4) for k, v in host.items()},
                  "compile_steps_s": [round(d, 1) for d in dt if d > 5]}))
