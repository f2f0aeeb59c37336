#!/usr/bin/env bash
# Session 12, device call 2 (a fresh H200, <= 530 s).  Call 1 (study.sh) made setup c, but its target took
# 204 s (2500 steps at 68 ms) and its 20 runs shared 16 host cores (CPU-bound: the niced runs stepped at
# ~0.22 s), so every run was cut at 28-75% of its 1000-step schedule, and the shapes' alone starts were starved
# (1 of 7 timed).  The machine was given back before call 1's target could be reused, so this call makes setup
# c again with a shorter target run (1500 steps: the same command otherwise) and runs every config on a
# 500-step schedule (the schedule of sessions 8-11; the 2x partner is 1000 steps, at nice -5 as the longest),
# seeds 0 and 1, eval every 100; then times the shapes alone (alone.py: the starts after the study, all at
# once, each stopped after its first step, then resumed one at a time).  lr 1.2e-3 is left out (call 1: below
# the base from step 200 on, on both seeds).
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s); el() { echo "t=$(( $(date +%s) - T0 ))s $*"; }
date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
END=$(( T0 + ${END_S:-520} ))
STUDY_END=$(( END - ${ALONE_S:-110} ))
W=/tmp/recipe_c
mkdir -p /tmp/c $OUT/c $OUT/c2x $OUT/alone
python3 stages/make_dataset.py --out /tmp/c/data --seed 2 > /tmp/make_c.log 2>&1 || { cat /tmp/make_c.log; exit 1; }
timeout ${TARGET_S:-170} python3 stages/make_target.py --data /tmp/c/data --out /tmp/c/target --seed 2 --hidden 512 \
  --intermediate 1536 --layers 12 --heads 8 --kv-heads 4 --steps ${TARGET_STEPS:-1500} --extra 40000 --threads 16 >> /tmp/make_c.log 2>&1
el "make c: exit $?"
tr '\r' '\n' < /tmp/make_c.log | grep -v '^---' | grep -v 'train target' | grep "done in"
cp /tmp/c/target/TRAINING.json $OUT/c/target_c_TRAINING.json || { tr '\r' '\n' < /tmp/make_c.log | tail -40 > $OUT/study_log.txt; exit 1; }
C=c:/tmp/c/target:/tmp/c/data/train.jsonl:/tmp/c/data/heldout.jsonl:cli5
python3 bench/recipe_study.py --setup $C \
  --configs c_base,c_peer,c_rows4,c_bb16384,c_b8,c_lr3e-4,c_l3,c_l1 --seeds 0,1 --steps 500 \
  --eval-every 100 --parallel 16 --online-configs c_base,c_peer,c_l1 --online-samples 50 \
  --end-at $STUDY_END --work $W --out $OUT/c > /tmp/study2_c.log 2>&1 &
PC=$!
until grep -q "precompute done" /tmp/study2_c.log || ! kill -0 $PC 2>/dev/null; do sleep 1; done
el "stores:"; grep "stores\|precompute" /tmp/study2_c.log
nice -n -5 python3 bench/recipe_study.py --setup $C --configs c_base_1000 --seeds 0,1 --steps 500 --eval-every 100 \
  --parallel 2 --online-configs c_base_1000 --online-samples 50 --reuse-stores --end-at $STUDY_END --work $W \
  --out $OUT/c2x > /tmp/study2_c2x.log 2>&1 &
P2=$!
wait $PC; el "study c: exit $?"
wait $P2; el "study c2x: exit $?"
touch /tmp/study_done
python3 docs/bench-results/2026-12-01-session12/recipe/alone.py --setup $C \
  --configs c_base,c_l1,c_l3,c_b8,c_rows4,c_bb16384,c_peer --work $W --go-file /tmp/study_done \
  --end-at $(( END - 3 )) --out $OUT/alone > /tmp/alone2.log 2>&1; el "alone: exit $?"
{ tr '\r' '\n' < /tmp/make_c.log | grep -v 'train target'; cat /tmp/study2_c.log /tmp/study2_c2x.log /tmp/alone2.log; } > $OUT/study_log.txt
( cd /tmp && tar czf $OUT/runs.tgz --exclude=checkpoints --exclude=tb --exclude="*.safetensors" recipe_c/c/runs recipe_c/alone \
  recipe_c/*.log c/target/config.json ) 2>&1 | tail -2
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
