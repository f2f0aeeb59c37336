#!/usr/bin/env bash
# Session 12, device call 2 (the same warm H200, <= 540 s): call 1 (study.sh) made setup c and its stores, but
# its target took 204 s and its 20 runs shared 16 host cores (CPU-bound: the niced runs stepped at ~0.22 s), so
# every run was cut at 28-75% of its schedule, and the shapes' alone starts were starved (1 of 7 timed).
# This call takes call 1's target and stores as they are on the machine (/tmp/c, /tmp/recipe_c; it stops if
# they are gone), runs fewer configs to their end (eval every 200 steps, nothing niced but c_2x, which runs
# at nice -5: it is the longest), then times the shapes alone (alone.py, the starts after the study, at once).
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "t=$(( $(date +%s) - T0 ))s $*"; }
W=/tmp/recipe_c
ls /tmp/c/target/model.safetensors $W/c/*.done || { echo "call 1's target or stores are gone"; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
END=$(( T0 + ${END_S:-530} ))
STUDY_END=$(( END - ${ALONE_S:-115} ))
rm -f /tmp/study_done; mkdir -p $OUT/c $OUT/c2x $OUT/alone
cp /tmp/c/target/TRAINING.json $OUT/c/target_c_TRAINING.json
C=c:/tmp/c/target:/tmp/c/data/train.jsonl:/tmp/c/data/heldout.jsonl:cli5
python3 bench/recipe_study.py --setup $C \
  --configs c_base,c_peer,c_rows4,c_lr3e-4,c_l1,c_bb16384@0,c_b8@0,c_l3@0 --seeds 0,1 --steps 1000 \
  --eval-every 200 --parallel 15 --online-configs c_base,c_peer,c_l1 --online-samples 50 --reuse-stores \
  --end-at $STUDY_END --work $W --out $OUT/c > /tmp/study2_c.log 2>&1 &
PC=$!
nice -n -5 python3 bench/recipe_study.py --setup $C --configs c_2x --seeds 0,1 --steps 1000 --eval-every 200 \
  --parallel 2 --online-configs c_2x --online-samples 50 --reuse-stores --end-at $STUDY_END --work $W \
  --out $OUT/c2x > /tmp/study2_c2x.log 2>&1 &
P2=$!
wait $PC; el "study c: exit $?"
wait $P2; el "study c2x: exit $?"
touch /tmp/study_done
python3 docs/bench-results/2026-12-01-session12/recipe/alone.py --setup $C \
  --configs c_base,c_l1,c_l3,c_b8,c_rows4,c_bb16384,c_peer --work $W --go-file /tmp/study_done \
  --end-at $(( END - 3 )) --out $OUT/alone > /tmp/alone2.log 2>&1; el "alone: exit $?"
cat /tmp/study2_c.log /tmp/study2_c2x.log /tmp/alone2.log > $OUT/study_log.txt
( cd /tmp && tar czf $OUT/runs.tgz --exclude=checkpoints --exclude=tb --exclude="*.safetensors" recipe_c/c/runs recipe_c/alone ) 2>&1 | tail -2
grep -h '"heldout_tau"' /tmp/study2_c.log /tmp/study2_c2x.log | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); o=r.get('online') or {}
    print(r['config'], r['seed'], 'tau', r.get('heldout_tau') and round(r['heldout_tau'],3), 'steps', r.get('steps'), 'wall', r.get('wall_s'), 'TF', r.get('train_flops') and round(r['train_flops']/1e12,1), 'online', o.get('tau') and round(o['tau'],3), o.get('lossless'), o.get('error', '')[:150], r.get('partial'), r.get('error', '')[:300])"
grep -h '"step_s_median"' /tmp/alone2.log | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print('alone', r['config'], 'step_s', r.get('step_s_median') and round(r['step_s_median'],4), 'n', r.get('steps_measured'), 'wait', r.get('data_wait_frac_median') and round(r['data_wait_frac_median'],3), 'samples/step', r.get('samples_per_step'), r.get('error',''))"
grep "started\|stopped" /tmp/alone2.log
el "end"
