#!/usr/bin/env bash
# Session 11, device call 2 (one H200, <= 480 s), after call 1 (study.sh) found --drafter-init target below the
# default at 500 steps on both setups: does the gap close with twice the steps? And base_3000's second seed.
#  setup a: init_target_1000 2 seeds (online tau seed 0); base_3000 seed 1 with online tau; base seed 1 (the
#  control: session 8 gave 3.44)
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s); el() { echo "t=$(( $(date +%s) - T0 ))s $*"; }
date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
END=$(( T0 + ${END_S:-440} ))
A=a:data/target:data/train.jsonl:data/heldout.jsonl
mkdir -p $OUT/a2
python3 bench/recipe_study.py --setup $A --configs base_3000@1,init_target_1000,base@1 --seeds 0,1 \
  --online-configs base_3000@1,init_target_1000 --online-samples 100 --parallel 4 \
  --end-at $END --work /tmp/recipe_a2 --out $OUT/a2 > $OUT/followup_log.txt 2>&1
el "study a2: exit $?"
grep -h '"heldout_tau"' $OUT/followup_log.txt | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); o=r.get('online') or {}
    print(r['setup'], r['config'], r['seed'], 'tau', r['heldout_tau'] and round(r['heldout_tau'],3), 'steps', r['steps'], 'wall', r['wall_s'], 'online', o.get('tau') and round(o['tau'],3), o.get('lossless'), o.get('error', '')[:200], r['partial'])"
grep -h '"error"\|"skipped"' $OUT/followup_log.txt | cut -c1-600
el "end"
