#!/usr/bin/env bash
# Session 18, call 1 (carry .pieces/p1, .carry/old): the GGUF's first piece to /root/pieces; then, in the
# background while calls 2 and 3 carry the rest, the training step at the Qwen3-8B shape before
# (.carry/old = git archive 10821d2 dflash bench) and after (this tree): bench33.sh.
set -u
mkdir -p /root/pieces && cp .pieces/p1/* /root/pieces/ || exit 3
rm -rf /root/now && mkdir -p /root/now && tar --exclude=./.pieces --exclude=./.carry --exclude=./.whl -cf - . | tar -C /root/now -xf -
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; df -h /root | tail -1
B=docs/bench-results/2026-12-03-session18/bench33.sh
# in /root (a call's checkout and /tmp do not outlive it)
mkdir -p /root/now/.carry /root/tmp /root/b33 && cp -r .carry/old /root/now/.carry/ && cd /root/now && \
  TMPDIR=/root/tmp B33_DEADLINE_S=${B33_DEADLINE_S:-200} setsid nohup bash $B /root/b33 > /root/b33/bench33.out 2>&1 < /dev/null &
sleep 1; echo call1 done
