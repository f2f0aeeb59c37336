#!/usr/bin/env bash
# NOT RUN (session 10 had one device call). What is left of the study's online tau: seed 0 of the main
# configs on the embedded default, retrained (setup a is deterministic: the same held-out tau as sessions 8
# and 10), then `dflash eval --prompts` over the 100 held-out prompts (real speculative decoding, lossless
# check). Expected ~350-450 s on one H200: ask for timeout_s 540, carry .whl.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s)
date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 bench/recipe_study.py --setup a:data/target:data/train.jsonl:data/heldout.jsonl \
  --configs base_2000,base_1500,bb8192,peer,base --seeds 0 --online-configs base_2000,base_1500,bb8192,peer,base \
  --online-samples 100 --parallel 5 --end-at $(( T0 + ${END_S:-500} )) --work /tmp/recipe --out $OUT/online \
  > $OUT/online_log.txt 2>&1
echo "exit $? after $(( $(date +%s) - T0 )) s"
grep -h '"heldout_tau"' $OUT/online_log.txt | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(r['config'], 'offline', round(r['heldout_tau'],3), 'online', r.get('online'))"
