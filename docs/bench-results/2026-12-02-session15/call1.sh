#!/usr/bin/env bash
# Session 15, call 1 (carry .pieces/p1, .whl, .carry/old): the GGUF's first piece to /root; the wheels to
# /root/site; the CUDA-only tests; the training step at the Qwen3-8B shape (3 layers, the CLI default) before
# (.carry/old = git archive 10821d2, before the house refactor) and after (this tree), 1 row (the default).
set -u
mkdir -p /root/pieces && cp .pieces/p1/* /root/pieces/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site .whl/*.whl || exit 1
mkdir -p /root/old && cp -r .carry/old/* /root/old/
. docs/bench-results/2026-12-02-session15/env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
echo "== CUDA-only tests"
timeout 80 python3 -m pytest -q -o addopts= -p no:cacheprovider -rs tests/shared/test_sliding_masks.py tests/train/test_loader.py 2>&1 | tail -6
export BENCH_ROWS_ONLY=1 BENCH_ROWS= BENCH_PART_LIMIT_S=85
export BENCH_VARIANTS="R=1,loss=triton"
for which in after before; do
  if [ $which = before ]; then dir=/root/old; else dir=$REPO; fi
  mkdir -p $OUT/step_$which
  ( cd $dir && OUT=$OUT/step_$which PYTHONPATH=/root/site:$dir timeout 100 python3 bench/train_step.py --layers 3 --steps 10 > $OUT/step_$which/log.txt 2>&1 )
  echo "$which: exit $?"; steps $OUT/step_$which/train_step.json
done
