#!/usr/bin/env bash
# Session 15, call 2 (carry .pieces/p2, .carry/d2): the GGUF's second piece and the prompts to /root; each
# screened configuration's training step alone on the GPU at the SmolLM2-135M shape (what one GPU-minute of
# it buys: docs/RECIPE.md counts a run's GPU-minutes as its steps x this); the DSpark step at the Qwen3-8B
# shape (call 1 timed the DFlash one); the capture rate against the bare forward.
set -u
mkdir -p /root/pieces && cp .pieces/p2/* /root/pieces/ && mkdir -p /root/data && cp .carry/d2/* /root/data/
. docs/bench-results/2026-12-02-session15/env.sh
export BENCH_ROWS_ONLY=1 BENCH_ROWS= BENCH_PART_LIMIT_S=75 BENCH_VARIANTS="R=1,loss=triton"
for c in dflash:16:3 dflash:8:3 dflash2:16:3 dspark:16:3 dflash:16:5; do
  IFS=: read arch b l <<< "$c"; d=$OUT/solo_${arch}_b${b}_l${l}; mkdir -p $d
  BENCH_SHAPE=smollm2-135m OUT=$d timeout 90 python3 bench/train_step.py --arch $arch --block-size $b --layers $l --steps 30 > $d/log.txt 2>&1
  echo "$c: exit $?"; steps $d/train_step*.json 2>/dev/null || tail -3 $d/log.txt
done
d=$OUT/dspark_8b; mkdir -p $d
BENCH_SHAPE=qwen3-8b BENCH_VARIANTS="R=1,loss=triton;R=16,chunk=8192,loss=triton" BENCH_PART_LIMIT_S=150 OUT=$d \
  timeout 170 python3 bench/train_step.py --arch dspark --layers 3 --steps 10 > $d/log.txt 2>&1
echo "dspark 8b: exit $?"; steps $d/train_step*.json 2>/dev/null || tail -3 $d/log.txt
