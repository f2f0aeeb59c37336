#!/usr/bin/env bash
# Session 10, one H200 call (<= 540 s): what remained of the recipe study (docs/RECIPE.md, issue 17).
#  parallel phase (shared GPU: tau against FLOPs), until T0 + ${PAR_S:-395} s:
#   setup a (embedded default): base_2000 (the FLOPs of the peer's 500 steps) 2 seeds; grad_accum 2 with the
#     loss normalised per step (default) vs per micro-batch, 2 seeds; base / bb8192 / peer seed 0; online tau
#     for seed 0 of base, bb8192, peer (100 held-out prompts) and base_2000 (50)
#   setup b (make_target --seed 1, 6 layers, as in session 8): base_1500 at lr 2e-3, 2 seeds (the equal-cost check
#     against session 8's bb8192 at lr 2e-3) and at lr 6e-4, seed 0; online tau (50 prompts) for seed 0
#  alone phase (nothing else on the GPU): steady-state seconds per step of each batch shape, 150 steps
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s); el() { echo "t=$(( $(date +%s) - T0 ))s $*"; }
date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
git log --oneline -1 2>/dev/null
END_PAR=$(( T0 + ${PAR_S:-395} ))
A=a:data/target:data/train.jsonl:data/heldout.jsonl
mkdir -p /tmp/b $OUT/a $OUT/a2 $OUT/b $OUT/alone
( python3 stages/make_dataset.py --out /tmp/b/data --seed 1 > /tmp/make_b.log 2>&1 &&
  python3 stages/make_target.py --data /tmp/b/data --out /tmp/b/target --seed 1 --layers 6 --steps 1500 --extra 20000 >> /tmp/make_b.log 2>&1
  echo "make b: exit $?"; el "make b done"; tail -2 /tmp/make_b.log; cp /tmp/b/target/TRAINING.json $OUT/b/target_b_TRAINING.json
  python3 bench/recipe_study.py --setup b:/tmp/b/target:/tmp/b/data/train.jsonl:/tmp/b/data/heldout.jsonl \
    --configs base_1500_lr2e-3,base_1500 --seeds 0,1 --seed0-configs base_1500 --parallel 3 \
    --online-configs base_1500_lr2e-3,base_1500 --online-samples 50 \
    --end-at $END_PAR --work /tmp/recipe --out $OUT/b > /tmp/study_b.log 2>&1; el "study b: exit $?" ) &
PB=$!
# the host's 16 cores are what the runs share most: the short a runs yield them (nice) to b and base_2000
nice -n 10 python3 bench/recipe_study.py --setup $A --configs ga2,ga2_micro,bb8192,peer,base --seeds 0,1 \
  --seed0-configs bb8192,peer,base --online-configs bb8192,peer,base --parallel 7 \
  --end-at $END_PAR --work /tmp/recipe2 --out $OUT/a2 > /tmp/study_a2.log 2>&1 &
PA2=$!
python3 bench/recipe_study.py --setup $A --configs base_2000 --seeds 0,1 --online-configs base_2000 --online-samples 50 --parallel 2 \
  --end-at $END_PAR --work /tmp/recipe --out $OUT/a > /tmp/study_a.log 2>&1
el "study a (base_2000): exit $?"
wait $PA2; el "study a2: exit $?"
wait $PB
el "parallel phase done"
# alone: one run at a time, eval off, 150 steps; seconds per step from the device timeline (median of steps 11+)
python3 bench/recipe_study.py --setup $A --configs base,bb8192,peer,ga2 --seeds 0 --steps 150 --eval-every 0 \
  --parallel 1 --run-timeout-s 40 --end-at $(( T0 + ${ALONE_END_S:-510} )) --run-suffix _alone --work /tmp/recipe --out $OUT/alone > /tmp/study_alone.log 2>&1
el "alone: exit $?"
cat /tmp/study_a.log /tmp/study_a2.log /tmp/study_b.log /tmp/study_alone.log /tmp/make_b.log > $OUT/study_log.txt
mv /tmp/recipe2/a/runs /tmp/recipe/a2_runs
tar czf $OUT/runs.tgz --exclude=checkpoints --exclude=tb --exclude="*.safetensors" -C /tmp/recipe a/runs a2_runs b/runs
grep -h '"heldout_tau"' $OUT/study_log.txt | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); o=r.get('online') or {}
    print(r['setup'], r['config'], r['seed'], 'tau', r['heldout_tau'] and round(r['heldout_tau'],3), 'steps', r['steps'], 'wall', r['wall_s'], 'step_s', r['step_s_median'] and round(r['step_s_median'],4), 'TF', round(r['train_flops']/1e12,1), 'online', o.get('tau') and round(o['tau'],3), o.get('lossless'), r['partial'])"
grep -h '"error"\|"skipped"' $OUT/study_log.txt | cut -c1-600
el "end"
