#!/usr/bin/env bash
# Session 11, device call 3 (one H200, <= 260 s): seconds per step alone on the device (nothing else on it,
# 150 steps, eval off, median of steps 11 on) of the default's and the peer recipe's batch shapes with 1
# DataLoader worker (params.yaml, as session 10 timed them) and with 4: how much of the equal-GPU-time
# comparison (base_1000 against peer) is the one worker's data wait.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s)
date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
mkdir -p $OUT/alone
python3 bench/recipe_study.py --setup a:data/target:data/train.jsonl:data/heldout.jsonl \
  --configs base,base_w4,peer,peer_w4 --seeds 0 --steps 150 --eval-every 0 --parallel 1 --run-timeout-s 45 \
  --end-at $(( T0 + ${END_S:-245} )) --run-suffix _alone --work /tmp/recipe --out $OUT/alone > $OUT/alone_log.txt 2>&1
echo "exit $? after $(( $(date +%s) - T0 )) s"
grep -h '"step_s_median"' $OUT/alone_log.txt | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(r['config'], 'steps', r['steps'], 'step_s', r['step_s_median'] and round(r['step_s_median'],4), 'samples', r['samples'], 'wall', r['wall_s'], r['partial'])"
python3 -c "
import json, glob, statistics as st
for m in sorted(glob.glob('/tmp/recipe/a/runs/*_alone/metrics.jsonl')):
    rs = [json.loads(l) for l in open(m) if l.strip().endswith('}')][10:]
    print(m.split('/')[-2], 'steps', len(rs) + 10, 'data_wait_frac median', round(st.median(r['data_wait_frac'] for r in rs), 3),
          'samples/step', round(st.mean(r['samples'] for r in rs), 1))
" | tee $OUT/alone/data_wait.txt
