#!/usr/bin/env bash
# Session 12, device call 1 (one H200, <= 560 s): the CLI's defaults for real targets measured at their own
# shape (block 16, 5 drafter layers, token budget = block budget 4096, 1 row per micro-batch, lr 6e-4) on a
# third, larger setup `c` made here by the project's own stages (12 layers, hidden 512).  docs/RECIPE.md, issue 17.
#  1. setup c: stages/make_dataset.py --seed 2; stages/make_target.py --seed 2, 12 layers x 512.
#  2. the study (bench/recipe_study.py, setup base cli5), every run at once on the shared GPU (tau against
#     FLOPs; wall seconds only comparable inside this call), seeds 0 and 1, 1000 steps unless named:
#     c_base, c_l1, c_l3, c_b8, c_rows4, c_bb16384, c_peer, c_lr3e-4, c_lr1.2e-3; c_2x (2000 steps, own
#     invocation, not niced); online tau (50 held-out prompts) for seed 0 of c_base, c_rows4, c_peer,
#     c_bb16384, c_l1, c_2x.
#  3. GPU-seconds: each batch shape's step ALONE on the device with 4 DataLoader workers (alone.py: the
#     processes start during the study's last ~110 s and are stopped after their first step; each is
#     resumed alone after the study and killed after 90 more steps (80 measured)).
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s); el() { echo "t=$(( $(date +%s) - T0 ))s $*"; }
date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
END=$(( T0 + ${END_S:-545} ))
STUDY_END=$(( END - ${ALONE_S:-85} ))
mkdir -p /tmp/c $OUT/c $OUT/c2x $OUT/alone
python3 stages/make_dataset.py --out /tmp/c/data --seed 2 > /tmp/make_c.log 2>&1 || { cat /tmp/make_c.log; exit 1; }
el "data made"
timeout ${TARGET_S:-230} python3 stages/make_target.py --data /tmp/c/data --out /tmp/c/target --seed 2 --hidden 512 \
  --intermediate 1536 --layers 12 --heads 8 --kv-heads 4 --steps ${TARGET_STEPS:-2500} --extra 40000 --threads 16 >> /tmp/make_c.log 2>&1
el "make c: exit $?"
tr '\r' '\n' < /tmp/make_c.log | grep -v '^---' | grep -v 'train target' | tail -5
cp /tmp/c/target/TRAINING.json $OUT/c/target_c_TRAINING.json || { tr '\r' '\n' < /tmp/make_c.log | tail -40 > $OUT/study_log.txt; exit 1; }
C=c:/tmp/c/target:/tmp/c/data/train.jsonl:/tmp/c/data/heldout.jsonl:cli5
W=/tmp/recipe_c
nice -n 5 python3 bench/recipe_study.py --setup $C \
  --configs c_base,c_rows4,c_peer,c_bb16384,c_l1,c_l3,c_b8,c_lr3e-4,c_lr1.2e-3 --seeds 0,1 --steps 1000 \
  --eval-every 100 --parallel 18 --online-configs c_base,c_rows4,c_peer,c_bb16384,c_l1 --online-samples 50 \
  --end-at $STUDY_END --work $W --out $OUT/c > /tmp/study_c.log 2>&1 &
PC=$!
until grep -q "precompute done" /tmp/study_c.log || ! kill -0 $PC 2>/dev/null; do sleep 1; done
el "stores:"; grep "stores\|precompute" /tmp/study_c.log
python3 bench/recipe_study.py --setup $C --configs c_2x --seeds 0,1 --steps 1000 --eval-every 100 --parallel 2 \
  --online-configs c_2x --online-samples 50 --reuse-stores --end-at $STUDY_END --work $W --out $OUT/c2x \
  > /tmp/study_c2x.log 2>&1 &
P2=$!
( while [ "$(date +%s)" -lt $(( STUDY_END - ${ALONE_START_S:-110} )) ]; do sleep 2; done; el "alone: starting the shapes"
  nice -n 10 python3 docs/bench-results/2026-12-01-session12/recipe/alone.py --setup $C \
    --configs c_base,c_l1,c_l3,c_b8,c_rows4,c_bb16384,c_peer --work $W --go-file /tmp/study_done \
    --end-at $(( END - 4 )) --out $OUT/alone > /tmp/alone.log 2>&1; el "alone: exit $?" ) &
PAL=$!
wait $PC; el "study c: exit $?"
wait $P2; el "study c2x: exit $?"
touch /tmp/study_done
el "study done; shapes alone:"
wait $PAL
el "all done"
{ tr '\r' '\n' < /tmp/make_c.log | grep -v 'train target'; cat /tmp/study_c.log /tmp/study_c2x.log /tmp/alone.log; } > $OUT/study_log.txt
( cd /tmp && tar czf $OUT/runs.tgz --exclude=checkpoints --exclude=tb --exclude="*.safetensors" recipe_c/c/runs recipe_c/alone \
  recipe_c/*.log c/target/config.json ) 2>&1 | tail -2
grep -h '"heldout_tau"' /tmp/study_c.log /tmp/study_c2x.log | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); o=r.get('online') or {}
    print(r['config'], r['seed'], 'tau', r.get('heldout_tau') and round(r['heldout_tau'],3), 'steps', r.get('steps'), 'wall', r.get('wall_s'), 'TF', r.get('train_flops') and round(r['train_flops']/1e12,1), 'samples', r.get('samples'), 'online', o.get('tau') and round(o['tau'],3), o.get('lossless'), o.get('error', '')[:150], r.get('partial'), r.get('error', '')[:300])"
grep -h '"step_s_median"' /tmp/alone.log | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print('alone', r['config'], 'step_s', r.get('step_s_median') and round(r['step_s_median'],4), 'n', r.get('steps_measured'), 'wait', r.get('data_wait_frac_median') and round(r['data_wait_frac_median'],3), 'samples/step', r.get('samples_per_step'), r.get('error',''))"
grep -h '"error"\|"skipped"' /tmp/study_c.log /tmp/study_c2x.log | cut -c1-600
ls -la $OUT $OUT/*
el "end"
