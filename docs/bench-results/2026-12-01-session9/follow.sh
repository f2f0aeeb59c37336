#!/usr/bin/env bash
# Session 9, H200 call B: `precompute --append` and `train --follow` at once on one GPU at the Qwen3-8B shape
# (bench/follow_bench.py: precompute alone first, then the trainer warm on 100 conversations while the
# append captures the other 1900).  fp8 hidden states: two stores of this size in bf16 do not fit the 64 GB disk.
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv
BENCH_WORK=/tmp/fb timeout 570 python3 bench/follow_bench.py --conversations 2000 --initial 100 --warm-steps 20 \
  --after-s 20 --hidden-dtype fp8 > $OUT/log.txt 2>&1
echo "exit $?"
grep "^\[follow" $OUT/log.txt | cut -c1-1500
tail -3 $OUT/log.txt
