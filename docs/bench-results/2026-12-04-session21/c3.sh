#!/usr/bin/env bash
# Session 21, call 3 (carry .pieces/p3, .whl): the last piece, the wheel joined and checked under /root/big,
# the carried wheels installed to /root/site.
set -u
[ -d /root/pieces ] || { echo "machine went cold: /root/pieces is gone"; exit 3; }
cp .pieces/p3/* /root/pieces/ && bash .pieces/p3/join.sh /root/pieces /root/big || exit 3
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site .whl/*.whl || exit 1
PYTHONPATH=/root/site:$PWD python3 -c "
import torch, transformers, zarr, gguf, datasets, dflash.cli
print(torch.__version__, transformers.__version__, zarr.__version__, torch.cuda.get_device_name())"
ls -la /root/big; rm -rf /root/pieces
