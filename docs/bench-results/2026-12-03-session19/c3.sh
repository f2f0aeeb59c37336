#!/usr/bin/env bash
# Session 19, call 3 (carry .pieces/p3, .carry/b): join the GGUF, copy this tree to /root/code (a call's tree
# does not outlive it), lay out /root/ex as examples/smollm2 with its cache and data, start study.py's
# driver in its own process session, then watch it (watch.sh) for WATCH_S seconds.
set -u
S=docs/bench-results/2026-12-03-session19
[ -d /root/site ] || { echo "machine went cold: /root/site is gone"; exit 3; }
cp .pieces/p3/* /root/pieces/ && bash .pieces/p3/join.sh /root/pieces /root/big || exit 3
rm -rf /root/code && mkdir -p /root/code /root/tmp && tar --exclude=./.pieces --exclude=./.carry --exclude=./.whl -cf - . | (cd /root/code && tar xf -)
E=/root/ex; rm -rf $E && mkdir -p $E/cache $E/data && cp -r examples/smollm2/params.yaml examples/smollm2/stages $E/
mv /root/big/SmolLM2-135M-Instruct.Q4_1.gguf $E/cache/
for f in /root/carry/*.xz .carry/b/*.xz; do xz -d -c $f > $E/data/$(basename $f .xz); done
wc -l $E/data/*.jsonl
cd $E && TMPDIR=/root/tmp PYTHONPATH=/root/site:/root/code PATH=/root/site/bin:$PATH PYTHONUNBUFFERED=1 \
  setsid nohup python3 /root/code/$S/study.py run > $E/driver.out 2>&1 < /dev/null &
sleep 2; cd /root/code && bash $S/watch.sh
