#!/usr/bin/env bash
# Session 17, call 3 (carry .pieces/p3, .carry/d2: the data, xz): join the GGUF, copy this tree to /root/code (a call's tree does not
# outlive it), lay out /root/ex as examples/smollm2 with its cache and data, and start study.py's driver in
# its own process session; then watch it (watch.sh) for WATCH_S seconds.
set -u
S=docs/bench-results/2026-12-02-session17
mkdir -p /root/pieces /root/data && cp .carry/d2/* /root/data/ && cp .pieces/p3/* /root/pieces/ && bash .pieces/p3/join.sh /root/pieces /root/big || exit 3
rm -rf /root/code && mkdir -p /root/code && tar --exclude=./.pieces -cf - . | (cd /root/code && tar xf -)
E=/root/ex; rm -rf $E && mkdir -p $E/cache $E/data && cp -r examples/smollm2/params.yaml examples/smollm2/stages $E/
mv /root/big/SmolLM2-135M-Instruct.Q4_1.gguf $E/cache/
for f in /root/data/*.xz; do xz -d -c $f > $E/data/$(basename $f .xz); done
wc -l $E/data/*.jsonl
cd $E && PYTHONPATH=/root/site:/root/code PATH=/root/site/bin:$PATH PYTHONUNBUFFERED=1 \
  SCREEN_STEPS=${SCREEN_STEPS:-600} LONG_STEPS=${LONG_STEPS:-3000} GEN_PROMPTS=${GEN_PROMPTS:-4000} EVALS=${EVALS:-3} EVAL_WORKERS=${EVAL_WORKERS:-4} CAPTURE_ONLY=${CAPTURE_ONLY:-} REF_FIRST=1 SOLO=${SOLO:-1} CAPTURE_EXP=${CAPTURE_EXP:-1} \
  setsid nohup python3 /root/code/$S/study.py run /root/code > $E/driver.out 2>&1 < /dev/null &
cd /root/code && bash $S/watch.sh
