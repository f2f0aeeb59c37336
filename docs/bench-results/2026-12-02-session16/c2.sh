#!/usr/bin/env bash
# Session 16, call 2 (carry .pieces/p2, .carry/d2): the GGUF's second piece and the data (xz) to /root.
set -u
[ -d /root/site ] || { echo "machine went cold: /root/site is gone"; exit 3; }
mkdir -p /root/pieces /root/data && cp .pieces/p2/* /root/pieces/ && cp .carry/d2/* /root/data/ || exit 3
ls -la /root/pieces /root/data
