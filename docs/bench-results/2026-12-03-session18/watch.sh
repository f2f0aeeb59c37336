#!/usr/bin/env bash
# Session 18: watch study.py's driver for WATCH_S seconds (the log as it grows), then the state of every run,
# the GPU, and study.py collect's summary into $OUT, with every run's metrics, the evals and the logs' tails.
set -u
E=/root/ex; S=/root/code/docs/bench-results/2026-12-03-session18
export PYTHONPATH=/root/site:/root/code PATH=/root/site/bin:$PATH
t0=$(date +%s); seen=${FROM_LINE:-0}
while [ $(( $(date +%s) - t0 )) -lt ${WATCH_S:-300} ]; do
  n=$(wc -l < $E/study.log 2>/dev/null || echo 0)
  [ "$n" -gt "$seen" ] && { sed -n "$((seen + 1)),${n}p" $E/study.log; seen=$n; }
  grep -q "driver: done\|driver: crashed\|stopping" $E/study.log 2>/dev/null && break
  sleep 5
done
echo "--- $(date +%T) study.log lines: $(wc -l < $E/study.log 2>/dev/null)"
tail -3 $E/driver.out 2>/dev/null
tail -1 $E/progress.log 2>/dev/null
for r in $E/logs/train_*.log $E/logs/generate.log; do [ -f $r ] && echo "$(basename $r): $(tail -c 300 $r | tr '\r' '\n' | grep -v '^\s*$' | tail -1)"; done
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader; uptime; df -h /root | tail -1
python3 $S/study.py collect > $OUT/study.json 2> $OUT/collect.err
cp $E/study.log $OUT/ 2>/dev/null
d=$(mktemp -d); mkdir -p $d/metrics $d/logs $d/eval $d/b33
for r in $E/runs/*/; do [ -f $r/metrics.jsonl ] && cp $r/metrics.jsonl $d/metrics/$(basename $r).jsonl; done
cp $E/eval/*@*.json $d/eval/ 2>/dev/null; cp $E/progress.log $d/ 2>/dev/null
for f in $E/logs/*.log; do tail -c 4000 $f > $d/logs/$(basename $f); done
cp /root/b33/*.json /root/b33/*.out /root/b33/*.txt $d/b33/ 2>/dev/null
tar -C $d -cJf $OUT/detail.tar.xz .; rm -rf $d
# the target's regenerated replies come back too (xz, ~1.5 MB): the next lease carries them instead of
# generating them again
[ -f $E/data/gen_all.jsonl ] && xz -T4 -c $E/data/gen_all.jsonl > $OUT/gen_all.jsonl.xz
ls -la $OUT
