#!/usr/bin/env bash
# Session 17 (started by c1.sh): bench/train_step.py at the Qwen3-8B shape, 3 layers, compile on, Triton loss,
# 1 packed row (the CLI default) and 16 rows, before (/root/old: 10821d2) and after (/root/now: this tree),
# alternating so that drift hits both; results in /root/b33/<which>_<rows>/train_step.json.
set -u
export PATH=/root/site/bin:$PATH PYTHONUNBUFFERED=1 BENCH_ROWS_ONLY=1 BENCH_ROWS= BENCH_PART_LIMIT_S=100
unset PYTHONDONTWRITEBYTECODE
for rows in 1 16; do
  for which in now old; do
    d=/root/b33/${which}_r$rows; mkdir -p $d
    ( cd /root/$which && OUT=$d PYTHONPATH=/root/site:/root/$which BENCH_VARIANTS="R=$rows,loss=triton" \
        timeout 150 python3 bench/train_step.py --layers 3 --steps 10 > $d/log.txt 2>&1 )
    echo "$(date +%T) $which rows $rows: exit $?"
  done
done
echo "$(date +%T) bench33 done"
