#!/usr/bin/env bash
# Session 17, call 1 (carry .pieces/p1, .whl, .carry/old): the GGUF's first piece to /root/pieces, the
# wheels to /root/site; then, in the background, the training step at the Qwen3-8B shape before
# (.carry/old = git archive 10821d2 dflash bench, the house review's commit) and after (this tree), 1 row
# (the CLI default) and 16 rows, alone on the GPU while calls 2 and 3 carry the rest (bench33.sh).
set -u
mkdir -p /root/pieces && cp .pieces/p1/* /root/pieces/ || exit 3
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site .whl/*.whl || exit 1
rm -rf /root/old /root/now && mkdir -p /root/old /root/now && tar -C .carry/old -cf - . | tar -C /root/old -xf - && tar --exclude=./.pieces --exclude=./.carry --exclude=./.whl -cf - . | tar -C /root/now -xf -
PYTHONPATH=/root/site:$PWD python3 -c "
import torch, transformers, zarr, gguf, datasets, dflash.cli
print(torch.__version__, transformers.__version__, zarr.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; df -h /root | tail -1
mkdir -p /root/b33 && setsid nohup bash /root/now/docs/bench-results/2026-12-02-session17/bench33.sh > /root/b33/bench33.out 2>&1 < /dev/null &
sleep 2; echo started bench33
