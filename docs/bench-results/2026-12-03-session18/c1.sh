#!/usr/bin/env bash
# Session 18, call 1 (carry .pieces/p1, .whl, .carry/old): the GGUF's first piece to /root/pieces, the wheels
# to /root/site; then, in the background while calls 2 and 3 carry the rest, the training step at the
# Qwen3-8B shape before (.carry/old = git archive 10821d2 dflash bench) and after (this tree): bench33.sh.
set -u
mkdir -p /root/pieces && cp .pieces/p1/* /root/pieces/ || exit 3
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site .whl/*.whl || exit 1
rm -rf /root/old /root/now && mkdir -p /root/old /root/now && tar -C .carry/old -cf - . | tar -C /root/old -xf - \
  && tar --exclude=./.pieces --exclude=./.carry --exclude=./.whl -cf - . | tar -C /root/now -xf -
PYTHONPATH=/root/site:$PWD python3 -c "
import torch, transformers, zarr, gguf, datasets, dflash.cli
print(torch.__version__, transformers.__version__, zarr.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; df -h /root | tail -1
B=docs/bench-results/2026-12-03-session18/bench33.sh
# in /root (a call's checkout and /tmp do not outlive it)
mkdir -p /root/now/.carry /root/tmp /root/b33 && cp -r .carry/old /root/now/.carry/ && cd /root/now && \
  TMPDIR=/root/tmp PATH=/root/site/bin:$PATH setsid nohup bash $B /root/b33 > /root/b33/bench33.out 2>&1 < /dev/null &
sleep 1; echo call1 done
