#!/usr/bin/env bash
# Session 13, H200 call 1: the training step at the Qwen3-8B shape with the CLI's default drafter depth
# (3 layers, reading target layers [1, 17, 33]) against z-lab's published 5-layer layout ([1, 9, 17, 25, 33]),
# same call, same bench: 1 packed row (the default recipe's micro-batch), 4 rows, 16 rows with lm_head chunk
# 8192; the Triton loss kernel (the CLI's default on CUDA).  20 timed steps per variant after warm-up.
set -u
export PYTHONUNBUFFERED=1 BENCH_ROWS_ONLY=1 BENCH_ROWS= BENCH_PART_LIMIT_S=${PART_S:-250}
export BENCH_VARIANTS="${BENCH_VARIANTS:-R=1,loss=triton;R=4,loss=triton;R=16,chunk=8192,loss=triton}"
date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
for layers in 3 5; do
  mkdir -p $OUT/L$layers
  OUT=$OUT/L$layers timeout $(( BENCH_PART_LIMIT_S + 20 )) python3 bench/train_step.py --layers $layers --steps 40 \
    > $OUT/L$layers/log.txt 2>&1
  echo "layers $layers: exit $?"
  python3 - $OUT/L$layers/train_step.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for k, v in d.items():
    if k.startswith("v_") and isinstance(v, dict) and "step_ms_wall_mean" in v:
        c = d[k + "_config"]
        print(k, "layers", c["layers"], c["target_layer_ids"], "params", c["drafter_params"], "step_ms", v["step_ms_wall_mean"],
              "median", v["step_ms_median"], "tflop", v["tflop_per_step"], "mfu", v["mfu"], "strict", v["mfu_strict"],
              "ctx_tok_s", v["ctx_tokens_per_s"], "peak_gib", v["peak_mem_gib_max"], "recompiles", v["recompiles_after_warmup"])
    elif k.startswith("v_") and isinstance(v, dict) and ("skipped" in v or "error" in v):
        print(k, v)
PY
done
