#!/usr/bin/env bash
# Session 17, call 2 (carry .pieces/p2): the GGUF's second piece to /root/pieces.
set -u
[ -d /root/site ] || { echo "machine went cold: /root/site is gone"; exit 3; }
mkdir -p /root/pieces && cp .pieces/p2/* /root/pieces/ || exit 3
ls -la /root/pieces /root/data
