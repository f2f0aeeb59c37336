#!/usr/bin/env bash
# Session 11, device call 4 (one H200, <= 540 s): held-out tau at equal GPU-seconds with 4 DataLoader workers
# (issue 17). Every run alone on the device, one after another (--parallel 1, nothing else on the GPU), full
# length with held-out eval every 100 steps, setup a (the embedded default), seed 0; each run's seconds per
# step from its own metrics (steady-state median of steps 11 on, recipe_study's step_s_median), so its
# GPU-seconds are its own steps x its own step.
#  1. control: base (1 worker, params.yaml), 150 steps, eval off (session 11's call 3 logged no step of it)
#  2. base_1000_w4 (1000 steps), peer_w4 (500), bb8192_w4 (500), then peer_1000_w4 (1000) if time is left;
#     runs still going at END are killed (curve so far kept, marked partial)
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s); el() { echo "t=$(( $(date +%s) - T0 ))s $*"; }
END=$(( T0 + ${END_S:-500} ))
date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "compute apps on the GPU before the runs: [$(nvidia-smi --query-compute-apps=pid,name --format=csv,noheader)]"
A=a:data/target:data/train.jsonl:data/heldout.jsonl
mkdir -p $OUT/control
python3 bench/recipe_study.py --setup $A --configs base --seeds 0 --steps 150 --eval-every 0 --parallel 1 \
  --run-timeout-s 75 --end-at $END --run-suffix _alone --work /tmp/recipe_ctl --out $OUT/control > $OUT/control_log.txt 2>&1
el "control: exit $?"
python3 bench/recipe_study.py --setup $A --configs base_1000_w4,peer_w4,bb8192_w4,peer_1000_w4 --seeds 0 \
  --steps 500 --eval-every 100 --parallel 1 --end-at $END --work /tmp/recipe --out $OUT > $OUT/workers4_log.txt 2>&1
el "workers4: exit $?"
grep -h '"error"\|"skipped"' $OUT/control_log.txt $OUT/workers4_log.txt | cut -c1-600
for f in $OUT/control/recipe.json $OUT/recipe.json; do [ -f $f ] && python3 -c "
import json, sys
for r in json.load(open(sys.argv[1]))['runs']:
    if not r or 'error' in r: continue
    st = r['step_s_median']
    print(r['config'], 'steps', r['steps'], 's/step', st and round(st, 4), 'GPU-s', st and round(st * r['steps'], 1),
          'heldout_tau', r['heldout_tau'] and round(r['heldout_tau'], 4), 'samples', r['samples'],
          'TFLOPs', round(r['train_flops'] / 1e12, 1), 'wall', r['wall_s'], 'partial', r['partial'])
    print('  curve', [(s, round(t, 3)) for s, t in r['curve']])
" $f; done
python3 -c "
import json, glob, statistics as st
for m in sorted(glob.glob('/tmp/recipe*/a/runs/*/metrics.jsonl')):
    rs = [json.loads(l) for l in open(m) if l.strip().endswith('}')]
    late = rs[10:]
    if not late:
        print(m, 'records', len(rs)); continue
    print(m.split('/')[-2], 'steps', len(rs), 'data_wait_frac median', round(st.median(r['data_wait_frac'] for r in late), 3),
          'samples/step', round(st.mean(r['samples'] for r in late), 1))
"
for l in /tmp/recipe*/a/runs/*.log; do echo "== $l"; tr '\r' '\n' < $l | grep -v '^\s*$' | tail -n 6; done > $OUT/train_logs.txt 2>&1
(cd /tmp && tar czf $OUT/metrics.tgz recipe*/a/runs/*/metrics.jsonl recipe*/a/runs/*/config.json) 2>&1 | tail -2
el "end"
