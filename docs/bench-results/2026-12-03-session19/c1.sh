#!/usr/bin/env bash
# Session 19, call 1 (carry .pieces/p1, .carry/a): the GGUF's first pieces and the held-out conversations to /root.
set -u
mkdir -p /root/pieces /root/carry && cp .pieces/p1/* /root/pieces/ && cp .carry/a/* /root/carry/ || exit 3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; free -g | head -2; df -h /root | tail -1
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
echo call1 done
