#!/usr/bin/env bash
# Session 9, H200 call C: the training DataLoader at Qwen3-8B width with and without the per-sample
# checksums (issue 19 item 2), each worker count twice per setting, alternating.
set -u
export PYTHONUNBUFFERED=1 BENCH_LOADER_VERIFY_AB=1 BENCH_PART_LIMIT_S=420 BENCH_WORK=/tmp/lb
timeout 450 python3 bench/loader_bench.py --part loader > $OUT/log.txt 2>&1
echo "exit $?"
python3 - $OUT/loader.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(json.dumps(d.get("store")))
for k, v in (d.get("loader") or {}).items():
    runs = v if isinstance(v, list) else [v]
    print(k, [(r.get("ctx_tokens_per_s"), r.get("gb_per_s"), r.get("batches")) for r in runs if isinstance(r, dict)])
print(json.dumps(d.get("cold_cache"))[:400])
PY
