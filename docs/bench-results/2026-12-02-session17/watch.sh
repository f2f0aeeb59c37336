#!/usr/bin/env bash
# Session 17: watch study.py's driver for WATCH_S seconds (the log as it grows), then the state of every
# run, the GPU, and study.py collect's summary into $OUT (with the log and the runs' metrics).
set -u
E=/root/ex; S=/root/code/docs/bench-results/2026-12-02-session17
export PYTHONPATH=/root/site:/root/code PATH=/root/site/bin:$PATH
t0=$(date +%s); seen=0; n0=${FROM_LINE:-$(grep -n "driver: screen" $E/study.log 2>/dev/null | tail -1 | cut -d: -f1)}; n0=${n0:-1}
while [ $(( $(date +%s) - t0 )) -lt ${WATCH_S:-300} ]; do
  n=$(wc -l < $E/study.log 2>/dev/null || echo 0)
  [ "$n" -gt "$seen" ] && { sed -n "$((seen + 1)),${n}p" $E/study.log; seen=$n; }
  tail -n +$n0 $E/study.log 2>/dev/null | grep -q "driver: done\|driver: crashed\|stopping" && break
  sleep 5
done
tail -5 $E/driver.out 2>/dev/null
for r in $E/logs/train_*.log $E/logs/generate.log; do [ -f $r ] && echo "$(basename $r): $(tail -c 400 $r | tr '\r' '\n' | grep -v '^\s*$' | tail -1)"; done
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader; uptime; df -h /root | tail -1
python3 $S/study.py collect > $OUT/study.json 2> $OUT/collect.err
cp $E/study.log $OUT/; cp $E/capture_rate.json $E/gpu.log $OUT/ 2>/dev/null
mkdir -p $OUT/b33 && cp /root/b33/bench33.out $OUT/b33/ 2>/dev/null; for d in /root/b33/*_r*/; do [ -f $d/train_step.json ] && cp $d/train_step.json $OUT/b33/$(basename $d).json; done
# per-run metrics, every eval's JSON and the tails of the logs, as one archive (a call brings back few files)
d=$(mktemp -d); mkdir -p $d/metrics $d/logs $d/eval
for r in $E/runs/*/ $E/solo/*/; do [ -f $r/metrics.jsonl ] && cp $r/metrics.jsonl $d/metrics/$(basename $(dirname $r))_$(basename $r).jsonl; done
cp $E/eval/*@*.json $d/eval/ 2>/dev/null
for f in $E/logs/*.log; do tail -c 3000 $f > $d/logs/$(basename $f); done
tar -C $d -cJf $OUT/detail.tar.xz metrics logs eval; rm -rf $d
