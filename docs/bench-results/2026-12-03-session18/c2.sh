#!/usr/bin/env bash
# Session 18, call 2 (carry .pieces/p2): the GGUF's second piece to /root/pieces.
set -u
[ -d /root/site ] || { echo "machine went cold: /root/site is gone"; exit 3; }
mkdir -p /root/pieces && cp .pieces/p2/* /root/pieces/ || exit 3
ls -la /root/pieces; tail -3 /root/b33/bench33.out 2>/dev/null
