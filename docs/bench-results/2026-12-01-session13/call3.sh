#!/usr/bin/env bash
# Session 13, H200 call 3: block 8 against block 16 at the default depth (3 layers), 500 steps, setup c made
# again as in call 2; online tau and speed-up (50 held-out prompts) for both seeds of both.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s); el() { echo "t=$(( $(date +%s) - T0 ))s $*"; }
date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
END=$(( T0 + ${END_S:-550} ))
W=/tmp/recipe_c
mkdir -p /tmp/c $OUT/c
python3 stages/make_dataset.py --out /tmp/c/data --seed 2 > /tmp/make_c.log 2>&1 || { cat /tmp/make_c.log; exit 1; }
timeout ${TARGET_S:-170} python3 stages/make_target.py --data /tmp/c/data --out /tmp/c/target --seed 2 --hidden 512 \
  --intermediate 1536 --layers 12 --heads 8 --kv-heads 4 --steps ${TARGET_STEPS:-1500} --extra 40000 --threads 16 >> /tmp/make_c.log 2>&1
el "make c: exit $?"
cp /tmp/c/target/TRAINING.json $OUT/c/target_c_TRAINING.json || { tr '\r' '\n' < /tmp/make_c.log | tail -40 > $OUT/study_log.txt; exit 1; }
C=c:/tmp/c/target:/tmp/c/data/train.jsonl:/tmp/c/data/heldout.jsonl:cli5
python3 bench/recipe_study.py --setup $C --configs c_l3,c_l3_b8 --seeds 0,1 --steps 500 \
  --eval-every 100 --parallel 4 --online-configs c_l3@0+1,c_l3_b8@0+1 --online-samples 50 \
  --end-at $END --work $W --out $OUT/c > /tmp/study_c.log 2>&1
el "study c: exit $?"
{ tr '\r' '\n' < /tmp/make_c.log | grep -v 'train target'; cat /tmp/study_c.log; } > $OUT/study_log.txt
( cd /tmp && tar cJf $OUT/metrics.tar.xz --exclude=checkpoints --exclude=tb --exclude="*.safetensors" recipe_c/c/runs ) 2>&1 | tail -2
grep -h '"heldout_tau"' /tmp/study_c.log | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); o=r.get('online') or {}
    print(r['config'], r['seed'], 'tau', r.get('heldout_tau') and round(r['heldout_tau'],3), 'steps', r.get('steps'), 'wall', r.get('wall_s'), 'TF', r.get('train_flops') and round(r['train_flops']/1e12,1), 'online', o.get('tau') and round(o['tau'],3), o.get('lossless'), o.get('error', '')[:150], r.get('partial'), r.get('error', '')[:300])"
el "end"
