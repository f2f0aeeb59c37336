#!/usr/bin/env bash
# Session 14, device call 1: where precompute's time goes for a small target (issue: capture is slow for
# small targets). Random-weight targets of SmolLM2-135M's and Qwen3-1.7B's shapes with SmolLM2's tokenizer,
# on 1000 ShareGPT conversations of examples/smollm2 (carried as .carry/train.jsonl.xz).
#   carry: [".whl", ".carry"]
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; python3 -c "import torch,transformers;print(torch.__version__,transformers.__version__)"
mkdir -p /root/d && xz -d -c .carry/train.jsonl.xz > /root/d/train.jsonl && head -1000 /root/d/train.jsonl > /root/d/train1k.jsonl
B=bench/capture_rate.py; TOKDIR=tests/assets/smollm2-tokenizer
python3 $B --make-random smollm2-135m /root/smol --tokenizer $TOKDIR 2>&1 | grep -v Writing
python3 $B --target /root/smol --data /root/d/train1k.jsonl --rows 1000 --token-budget 16384 65536 --out $OUT/rate_smol.json
pc() { python3 -m dflash.cli precompute --target "$1" --data /root/d/train1k.jsonl --out "$2" --max-length 2048 --gpus 0 --num-draft-layers 3 "${@:3}"; }
/usr/bin/time -v py-spy record --subprocesses --idle --format raw --rate 50 -o $OUT/pyspy_smol_16k.txt -- \
  python3 -m dflash.cli precompute --target /root/smol --data /root/d/train1k.jsonl --out /root/s1 --max-length 2048 --gpus 0 --num-draft-layers 3 2>&1 | grep -v "it/s\]" | tail -25
( time pc /root/smol /root/s2 --token-budget 65536 ) 2>&1 | grep -v "it/s\]" | tail -4
python3 $B --make-random qwen3-1.7b /root/q17 --tokenizer $TOKDIR 2>&1 | grep -v Writing
python3 $B --target /root/q17 --data /root/d/train1k.jsonl --rows 500 --token-budget 16384 --out $OUT/rate_q17.json
( time pc /root/q17 /root/s3 --max-samples 500 ) 2>&1 | grep -v "it/s\]" | tail -4
df -h /root | tail -1
