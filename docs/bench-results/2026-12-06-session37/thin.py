"""Session 37: thin DRG's metrics (20,000 rows, 19 MB) to what the study reads: every 25th step, every eval
row and the first 50 steps, each with `minutes_alone`, the step times (ctx_tokens / ctx_tokens_per_s)
summed over every step, as session 32's `metrics_sampled.jsonl.xz`.

    python docs/bench-results/2026-12-06-session37/thin.py DETAIL_DIR/metrics/DRG.jsonl results/metrics_sampled.jsonl.xz
"""
import json
import lzma
import sys

spent, kept = 0.0, []
for line in open(sys.argv[1]):
    r = json.loads(line)
    spent += r["ctx_tokens"] / r["ctx_tokens_per_s"] / 60
    if r["step"] % 25 == 0 or r["step"] <= 50 or "eval_walk_tau" in r:
        kept.append({**r, "minutes_alone": round(spent, 4)})
with lzma.open(sys.argv[2], "wt") as f:
    f.writelines(json.dumps(r) + "\n" for r in kept)
print(f"{len(kept)} rows kept; {spent:.2f} minutes alone in all")
