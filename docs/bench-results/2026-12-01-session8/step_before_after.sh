#!/usr/bin/env bash
# Session 8, H200 call C: the training step at the Qwen3-8B shape before (196f427, flat layout, the step
# inlined in train.py) and after (the Trainer / TrainStep refactor), same bench, same variants.
set -u
export PYTHONUNBUFFERED=1 BENCH_ROWS_ONLY=1 BENCH_ROWS= BENCH_PART_LIMIT_S=265
export BENCH_VARIANTS="${BENCH_VARIANTS:-R=16,chunk=8192,loss=triton;R=1,loss=triton}"
nvidia-smi --query-gpu=name,memory.total --format=csv
for which in after before; do
  if [ $which = before ]; then dir=.devold; else dir=.; fi
  mkdir -p $OUT/$which
  ( cd $dir && OUT=$OUT/$which PYTHONPATH=$PWD timeout 280 python3 bench/train_step.py > $OUT/$which/log.txt 2>&1 )
  echo "$which: exit $?"
  python3 - $OUT/$which/train_step.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for k, v in d.items():
    if k.startswith("v_") and isinstance(v, dict) and "step_ms_wall_mean" in v:
        print(k, "step_ms", v["step_ms_wall_mean"], "median", v["step_ms_median"], "mfu", v["mfu"], "ctx_tok_s", v["ctx_tokens_per_s"], "peak_gib", v["peak_mem_gib_max"], "recompiles", v["recompiles_after_warmup"])
PY
done
