#!/usr/bin/env bash
# Session 17, a last call (carry .whl, .carry/d2): the capture against the bare forward, in-process and through
# `dflash precompute` (--cli), at random-weight targets of SmolLM2-135M's, Qwen3-1.7B's and Qwen3-8B's shapes
# (SmolLM2's tokenizer), on the first ShareGPT training conversations; one JSON per shape in $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site .whl/*.whl || exit 1
export PYTHONPATH=/root/site:$PWD PATH=/root/site/bin:$PATH PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE
mkdir -p /root/d && xz -d -c .carry/d2/train.jsonl.xz > /root/d/train.jsonl
B=bench/capture_rate.py; TOK=tests/assets/smollm2-tokenizer
for spec in "smollm2-135m 2000 65536" "qwen3-1.7b 1000 16384" "qwen3-8b 300 16384"; do
  set -- $spec
  python3 $B --make-random $1 /root/m_$1 --tokenizer $TOK 2>&1 | grep -v Writing | tail -2
  timeout 240 python3 $B --target /root/m_$1 --data /root/d/train.jsonl --rows $2 --token-budget $3 --layers 3 \
    --cli --cli-dir /root/cli_$1 --out $OUT/rate_$1.json 2>&1 | tr '\r' '\n' | grep -v "it/s\]\|sample/s" | tail -4
  echo "$(date +%T) $1: exit $?"; rm -rf /root/m_$1 /root/cli_$1
done
