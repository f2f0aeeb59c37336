#!/usr/bin/env bash
# Session 8, H200 calls A and B: the recipe study (docs/RECIPE.md) on two setups.
#   setup a: the embedded default (data/target, data/train.jsonl, data/heldout.jsonl)
#   setup b: a second target made here: make_dataset --seed 1, make_target --seed 1 --layers 6 --steps 1500 --extra 20000
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv
mkdir -p /tmp/b
( python3 stages/make_dataset.py --out /tmp/b/data --seed 1 > $OUT/make_b.log 2>&1 &&
  python3 stages/make_target.py --data /tmp/b/data --out /tmp/b/target --seed 1 --layers 6 --steps 1500 --extra 20000 >> $OUT/make_b.log 2>&1 ) &
MAKE_B=$!
A_CONFIGS="${A_CONFIGS:-base,peer,anchors512_bb8192,lr6e-4,bb8192,anchors512,minlr0,beta2_0.999,gamma7,kd0.5,layers03,peer_lr2e-3,wd0.01,anchors256_bb8192,rows2,tb4096,lr1e-3,anchors512_bb4096}"
B_CONFIGS="${B_CONFIGS:-base,peer,anchors512_bb8192,peer_lr2e-3,lr6e-4,bb8192,minlr0,beta2_0.999,gamma7,kd0.5}"
timeout 330 python3 bench/recipe_study.py --setup a:data/target:data/train.jsonl:data/heldout.jsonl \
  --configs "$A_CONFIGS" --seeds 0,1 --parallel "${PAR:-12}" --deadline-s "${A_DEADLINE:-220}" --work /tmp/recipe --out $OUT/a > $OUT/study_a.log 2>&1
echo "study a: exit $?"; tail -2 $OUT/study_a.log
wait $MAKE_B; echo "make b: exit $?"; tail -3 $OUT/make_b.log
cp /tmp/b/target/TRAINING.json $OUT/target_b_TRAINING.json 2>/dev/null
timeout 190 python3 bench/recipe_study.py --setup b:/tmp/b/target:/tmp/b/data/train.jsonl:/tmp/b/data/heldout.jsonl \
  --configs "$B_CONFIGS" --seeds 0,1 --parallel "${PAR:-12}" --deadline-s "${B_DEADLINE:-90}" --work /tmp/recipe --out $OUT/b > $OUT/study_b.log 2>&1
echo "study b: exit $?"; tail -2 $OUT/study_b.log
grep -h '"heldout_tau"' $OUT/study_a.log $OUT/study_b.log | python3 -c "
import json,sys,collections
d=collections.defaultdict(list)
for l in sys.stdin:
    r=json.loads(l); d[(r['setup'],r['config'])].append((r['heldout_tau'],r['wall_s'],r['train_flops']/1e15))
for k,v in sorted(d.items()): print(k, [tuple(round(x,3) for x in t) for t in v])"
