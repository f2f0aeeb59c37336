#!/usr/bin/env bash
# Session 21: watch study.py's driver for WATCH_S seconds (the log as it grows), then every run's state, the
# GPU, and study.py collect's summary into $OUT, with every run's metrics, the evals and the logs' tails, and
# the stores' status.
set -u
E=/root/ex; S=/root/code/docs/bench-results/2026-12-04-session21
export PYTHONPATH=/root/site:/root/code PATH=/root/site/bin:$PATH
t0=$(date +%s); seen=${FROM_LINE:-0}
while [ $(( $(date +%s) - t0 )) -lt ${WATCH_S:-300} ]; do
  n=$(wc -l < $E/study.log 2>/dev/null || echo 0)
  [ "$n" -gt "$seen" ] && { sed -n "$((seen + 1)),${n}p" $E/study.log; seen=$n; }
  tail -n 2 $E/study.log 2>/dev/null | grep -q "driver: done\|driver: crashed\|stopping" && break
  sleep 5
done
echo "--- $(date +%T) study.log lines: $(wc -l < $E/study.log 2>/dev/null)"
tail -3 $E/driver.out 2>/dev/null
tail -1 $E/progress.log 2>/dev/null
for r in $E/logs/train_*.log $E/logs/eval_*.log; do [ -f $r ] && echo "$(basename $r): $(tail -c 300 $r | tr '\r' '\n' | grep -v '^\s*$' | tail -1)"; done
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader; uptime; df -h /root | tail -1
python3 $S/study.py collect > $OUT/study.json 2> $OUT/collect.err
cp $E/study.log $OUT/ 2>/dev/null
d=$(mktemp -d); mkdir -p $d/metrics $d/logs $d/eval
for r in $E/runs/*/; do [ -f $r/metrics.jsonl ] && cp $r/metrics.jsonl $d/metrics/$(basename $r).jsonl; done
cp $E/eval/*@*.json $d/eval/ 2>/dev/null; cp $E/progress.log $E/forward_rate.json $d/ 2>/dev/null
for f in $E/logs/*.log; do tail -c 6000 $f > $d/logs/$(basename $f); done
tar -C $d -cJf $OUT/detail.tar.xz .; rm -rf $d
ls -la $OUT
