#!/usr/bin/env bash
# Session 19, call 2 (carry .pieces/p2, .whl): the GGUF's next pieces to /root/pieces, the wheels to /root/site.
set -u
[ -d /root/pieces ] || { echo "machine went cold: /root/pieces is gone"; exit 3; }
cp .pieces/p2/* /root/pieces/ || exit 3
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site .whl/*.whl || exit 1
PYTHONPATH=/root/site:$PWD python3 -c "
import torch, transformers, zarr, gguf, datasets, dflash.cli
print(torch.__version__, transformers.__version__, zarr.__version__, torch.cuda.get_device_name())"
ls -la /root/pieces
