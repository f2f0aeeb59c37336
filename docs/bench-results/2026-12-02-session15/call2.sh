#!/usr/bin/env bash
# Session 15, call 2 (carry .pieces/p2, .carry/d2, .carry/cap): the GGUF's second piece and the prompts to
# /root; each screened configuration's training step alone on the GPU at the SmolLM2-135M shape (docs/RECIPE.md
# counts a run's GPU-minutes as its steps x this); the DSpark step at the Qwen3-8B shape (call 1 timed DFlash's);
# the capture rate of a random SmolLM2-135M-shaped target against its bare forward, with the CLI loop of this
# tree (main) and of .carry/cap (= git archive of the branch `capture`, the writer rework).
set -u
mkdir -p /root/pieces && cp .pieces/p2/* /root/pieces/ && mkdir -p /root/data && cp .carry/d2/* /root/data/
. docs/bench-results/2026-12-02-session15/env.sh
export BENCH_ROWS_ONLY=1 BENCH_ROWS= BENCH_PART_LIMIT_S=60 BENCH_VARIANTS="R=1,loss=triton"
for c in dflash:16:3 dflash:8:3 dflash2:16:3 dspark:16:3; do
  IFS=: read arch b l <<< "$c"; d=$OUT/solo_${arch}_b${b}_l${l}; mkdir -p $d
  BENCH_SHAPE=smollm2-135m OUT=$d timeout 75 python3 bench/train_step.py --arch $arch --block-size $b --layers $l --steps 20 > $d/log.txt 2>&1
  echo "$c: exit $?"; steps $d/train_step*.json 2>/dev/null || tail -3 $d/log.txt
done
d=$OUT/dspark_8b; mkdir -p $d
BENCH_SHAPE=qwen3-8b BENCH_PART_LIMIT_S=75 OUT=$d timeout 90 python3 bench/train_step.py --arch dspark --layers 3 --steps 10 > $d/log.txt 2>&1
echo "dspark 8b: exit $?"; steps $d/train_step*.json 2>/dev/null || tail -3 $d/log.txt
xz -d -c /root/data/prompts.jsonl.xz > /root/prompts.jsonl
mkdir -p /root/cap && cp -r .carry/cap/* /root/cap/
( cd /root/cap && PYTHONPATH=/root/site:/root/cap timeout 120 python3 bench/capture_rate.py --make-random smollm2-135m /root/rand135 \
    --tokenizer $REPO/tests/assets/smollm2-tokenizer --data /root/prompts.jsonl --rows 1500 --token-budget 65536 --cli \
    --cli-dir /root/capcli --out $OUT/capture_after.json > $OUT/capture_after.log 2>&1 ); echo "capture (branch): exit $?"
tail -c 1500 $OUT/capture_after.json 2>/dev/null | tr -d '\n' ; echo
rm -rf /root/capmain; head -1500 /root/prompts.jsonl > /root/p2000.jsonl
timeout 100 $DF precompute --target /root/rand135 --data /root/p2000.jsonl --out /root/capmain --token-budget 65536 --topk 8 \
    --max-length 2048 --num-draft-layers 3 2>&1 | quiet | grep "precompute:"
python3 -c "
import json,glob
for f in glob.glob('/root/capmain/shard-*/status.json'):
    s=json.load(open(f)); print('main cli loop tok/s', round(s['new_tokens']/s['loop_s']), {k: s.get(k) for k in ('loop_s','render_workers')})"
