#!/usr/bin/env bash
# Session 11, device call 1 (one H200, <= 540 s): what remained of the recipe study (docs/RECIPE.md, issue 17).
# Everything runs at once on the shared GPU (tau against FLOPs; wall seconds are only comparable inside this call):
#  setup a (embedded default, deterministic across sessions):
#    init_target (--drafter-init target) 2 seeds, online tau seed 0; base_1000 2 seeds, online tau both;
#    base seed 0 (the control: sessions 8 and 10 gave 3.6316); peer seed 1 with online tau (seed 0 has 3.766);
#    base_3000 seed 0 (own invocation, not niced), online tau if time is left
#  setup b (made again here by stages/make_*.py --seed 1, as in sessions 8 and 10; every b row on this target):
#    base, init_target, base_1000, base_1500, peer, 2 seeds each
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s); el() { echo "t=$(( $(date +%s) - T0 ))s $*"; }
date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
END=$(( T0 + ${END_S:-500} ))
A=a:data/target:data/train.jsonl:data/heldout.jsonl
mkdir -p /tmp/b $OUT/a $OUT/a3000 $OUT/b
( python3 stages/make_dataset.py --out /tmp/b/data --seed 1 > /tmp/make_b.log 2>&1 &&
  python3 stages/make_target.py --data /tmp/b/data --out /tmp/b/target --seed 1 --layers 6 --steps 1500 --extra 20000 >> /tmp/make_b.log 2>&1
  echo "make b: exit $?"; el "make b done"; tail -2 /tmp/make_b.log; cp /tmp/b/target/TRAINING.json $OUT/b/target_b_TRAINING.json
  python3 bench/recipe_study.py --setup b:/tmp/b/target:/tmp/b/data/train.jsonl:/tmp/b/data/heldout.jsonl \
    --configs base_1500,base_1000,peer,init_target,base --seeds 0,1 --parallel 10 \
    --end-at $END --work /tmp/recipe_b --out $OUT/b > /tmp/study_b.log 2>&1; el "study b: exit $?" ) &
PB=$!
python3 bench/recipe_study.py --setup $A --configs base_3000 --seeds 0 --online-configs base_3000 --parallel 1 \
  --end-at $END --work /tmp/recipe_a3000 --out $OUT/a3000 > /tmp/study_a3000.log 2>&1 &
PA3=$!
nice -n 10 python3 bench/recipe_study.py --setup $A --configs base_1000,init_target,peer@1,base@0 --seeds 0,1 \
  --online-configs init_target,base_1000@0+1,peer@1 --online-samples 100 --parallel 7 \
  --end-at $END --work /tmp/recipe_a --out $OUT/a > /tmp/study_a.log 2>&1
el "study a: exit $?"
wait $PA3; el "study a3000: exit $?"
wait $PB
el "all done"
cat /tmp/study_a.log /tmp/study_a3000.log /tmp/study_b.log /tmp/make_b.log > $OUT/study_log.txt
tar czf $OUT/runs.tgz --exclude=checkpoints --exclude=tb --exclude="*.safetensors" -C /tmp recipe_a/a/runs recipe_a3000/a/runs recipe_b/b/runs 2>/dev/null
grep -h '"heldout_tau"' $OUT/study_log.txt | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); o=r.get('online') or {}
    print(r['setup'], r['config'], r['seed'], 'tau', r['heldout_tau'] and round(r['heldout_tau'],3), 'steps', r['steps'], 'wall', r['wall_s'], 'TF', round(r['train_flops']/1e12,1), 'online', o.get('tau') and round(o['tau'],3), o.get('lossless'), o.get('error', '')[:200], r['partial'])"
grep -h '"error"\|"skipped"' $OUT/study_log.txt | cut -c1-600
el "end"
