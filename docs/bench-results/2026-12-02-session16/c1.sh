#!/usr/bin/env bash
# Session 16, call 1 (carry .pieces/p1, .whl): the GGUF's first piece to /root/pieces, the wheels to /root/site.
set -u
mkdir -p /root/pieces && cp .pieces/p1/* /root/pieces/ || exit 3
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site .whl/*.whl || exit 1
PYTHONPATH=/root/site:$PWD python3 -c "
import torch, transformers, zarr, gguf, datasets, dflash.cli
print(torch.__version__, transformers.__version__, zarr.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; df -h /root | tail -1; ls -la /root/pieces
