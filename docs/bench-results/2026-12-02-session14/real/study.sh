#!/usr/bin/env bash
# Session 14, call 4: the levers, screened at once on the shared H200 (each run trains for TRAIN_S seconds of
# wall time, killed then; the last checkpoint is evaluated online: 100 held-out prompts, 128 new tokens).
#   carry: []   (everything is under /root from call 3)
set -uo pipefail
. docs/bench-results/2026-12-02-session14/real/env.sh
TRAIN_S=${TRAIN_S:-270}; EVAL_S=${EVAL_S:-230}
cd $E || exit 3
for i in $(seq 120); do grep -q GEN_DONE /root/gen.log && break; sleep 1; done
tr '\r' '\n' < /root/gen.log | grep -v "row/s\]\|it/s\]" | tail -3
cp /root/gen.log $OUT/generate.log 2>/dev/null
$DF precompute --data data/generated.jsonl --out stores/generated 2>&1 | quiet | grep "precompute:"
mkdir -p runs eval
T() { local name=$1 store=$2; shift 2
  setsid nohup timeout -s KILL $TRAIN_S $DF train --store stores/$store --out runs/$name --gpus 0 --steps 1500 \
    --save-every 250 --eval-every 0 --overwrite "$@" > runs/$name.log 2>&1 < /dev/null & }
T share_multi train
T share_first prompts
T gen generated
T gen_init generated --drafter-init target
T gen_lr2e-3 generated --lr 2e-3
T gen_anch256 generated --num-anchors 256
T gen_kd generated --kd-weight 1.0
T gen_b8 generated --block-size 8
sleep $((TRAIN_S + 5))
for r in runs/*/; do n=$(basename $r); ls $r/checkpoints 2>/dev/null | tail -1 | sed "s/^/$n last checkpoint: /"; done
for r in runs/*/; do n=$(basename $r)
  setsid nohup timeout -s KILL $EVAL_S $DF eval --run runs/$n --out eval/$n.json > eval/$n.log 2>&1 < /dev/null & done
sleep $((EVAL_S + 3))
python3 $REPO/docs/bench-results/2026-12-02-session14/real/collect.py runs eval > $OUT/study.json
cat $OUT/study.json
for r in runs/*.log; do tail -c 600 $r | tr '\r' '\n' | grep -i "error\|refus" | tail -2 | sed "s|^|$r: |"; done
for r in eval/*.log; do tail -c 400 $r | tr '\r' '\n' | grep -i "error\|tau" | tail -2 | sed "s|^|$r: |"; done
