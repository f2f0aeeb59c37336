#!/usr/bin/env bash
# Session 15, call 4 (nothing carried; call 3's runs are still training under /root/ex): online evals, 100
# held-out prompts x 128 new tokens, fp32, lossless-checked.  First one eval writes the target-only reference
# (eval --reference, started by call 3 on gen's first checkpoint); then the training runs are stopped and every
# run's newest checkpoint is evaluated, all at once.  Then the summary of every run and eval.
set -u
. docs/bench-results/2026-12-02-session15/env.sh
cd $E || exit 3
BUDGET=${BUDGET:-330}; t0=$(date +%s); left() { echo $(( BUDGET - ($(date +%s) - t0) )); }
EV() { local run=$1 ck=$2 tag=$3  # eval one checkpoint in its own process session
  setsid nohup timeout -s KILL $(( $(left) - 25 )) $DF eval --run runs/$run/checkpoints/$ck --prompts data/heldout.jsonl \
    --max-samples 100 --max-new-tokens 128 --reference eval/reference.json --no-plots \
    --out eval/$run@$tag.json > eval/$run@$tag.log 2>&1 < /dev/null & }
ck() { ls runs/$1/checkpoints 2>/dev/null | grep step- | sed -n "$2"; }
for r in runs/*.log; do echo "$r: $(tail -c 300 $r | tr '\r' '\n' | grep -v '^\s*$' | tail -1)"; done
for i in $(seq 200); do [ -f eval/reference.json ] && break; sleep 1; done
echo "reference written after $(( $(date +%s) - t0 )) s into this call"
pkill -f "dflash.cli train" ; sleep 3  # the screen ends here: the evals get the machine (checkpoints every 250 steps)
for r in runs/*/; do n=$(basename $r); c=$(ck $n '$p'); [ -n "$c" ] && EV $n $c $c; done
sleep $(( $(left) - 20 ))
for r in runs/*/; do n=$(basename $r); ls runs/$n/checkpoints | tail -1 | sed "s/^/$n newest: /"; done
python3 $S15/collect.py runs eval > $OUT/study.json; cat $OUT/study.json | python3 -c "
import json,sys; d=json.load(sys.stdin)
for k,v in d.items(): print(k, v.get('step'), v.get('tau'), v.get('evals'))"
mkdir -p $OUT/metrics && for r in runs/*/; do cp $r/metrics.jsonl $OUT/metrics/$(basename $r).jsonl 2>/dev/null; done
cp eval/*.json $OUT/ 2>/dev/null; rm -f $OUT/reference.json
for f in eval/*.log; do tail -c 400 $f | tr '\r' '\n' | grep -i "error\|refus\|tau" | tail -2 | sed "s|^|$f: |"; done
