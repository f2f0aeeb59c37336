#!/usr/bin/env bash
# Session 15, call 3 (carry .pieces/p3, .carry/d3; calls 1-2 left p1, p2, the wheels and d2 under /root):
# join the GGUF, build the example's target, capture ShareGPT (4K whole conversations) and the held-out
# store, regenerate the first exchanges with the target (8 generate processes on the one GPU), capture them,
# and start the screen: every run in its own process session (setsid), so it outlives this call while the
# machine stays warm; call 4 evaluates them.  Runs: 2000 steps, checkpoints every 250 (20 kept).
set -u
mkdir -p /root/pieces && cp .pieces/p3/* /root/pieces/ && bash .pieces/p3/join.sh /root/pieces /root/big || exit 3
. docs/bench-results/2026-12-02-session15/env.sh
rm -rf $E && mkdir -p $E/cache $E/data $E/runs $E/eval && cp -r examples/smollm2/params.yaml examples/smollm2/stages $E/
mv /root/big/SmolLM2-135M-Instruct.Q4_1.gguf $E/cache/
for f in /root/data/*.xz .carry/d3/*.xz; do xz -d -c $f > $E/data/$(basename $f .xz); done
cd $E && wc -l data/*.jsonl
t0=$(date +%s); python3 stages/target.py 2>&1 | quiet | grep -v Converting; echo "target built in $(( $(date +%s) - t0 )) s"
GEN="$DF generate --gpus 0,0,0,0,0,0,0,0 --batch-size 256"
setsid nohup bash -c "t=\$(date +%s); $GEN > /root/gen.log 2>&1; echo GEN_DONE \$(( \$(date +%s) - t )) s >> /root/gen.log" > /dev/null 2>&1 < /dev/null &
( time $DF precompute ) 2>&1 | quiet | grep "precompute:\|real"
$DF precompute --data data/heldout.jsonl --out stores/heldout 2>&1 | quiet | grep "precompute:"
STEPS=${STEPS:-2000}
T() { local name=$1 store=$2; shift 2
  setsid nohup $DF train --store stores/$store --out runs/$name --gpus 0 --steps $STEPS --save-every 250 \
    --keep-checkpoints 20 --eval-every 0 --overwrite "$@" > runs/$name.log 2>&1 < /dev/null & }
T share train
T share_tl train --labels target
for i in $(seq 400); do grep -q GEN_DONE /root/gen.log && break; sleep 1; done
tr '\r' '\n' < /root/gen.log | grep -v "row/s\]\|it/s\]" | tail -4; tr '\r' '\n' < /root/gen.log | grep "row/s" | tail -1
cp /root/gen.log $OUT/generate.log
( time $DF precompute --data data/generated.jsonl --out stores/generated --final-hidden ) 2>&1 | quiet | grep "precompute:\|real"
T gen generated
T gen_lr2e-3 generated --lr 2e-3
T gen_d2 generated --arch dflash2
T gen_init generated --drafter-init target
$DF train --help | grep -q "dspark" && T gen_dspark generated --arch dspark
date -u +%H:%M:%S > /root/runs_started
# the target-only reference of the online evals, written by the first eval (gen's first checkpoint), in the
# background: call 4's evals of every run then decode speculatively only
for i in $(seq 240); do ls runs/gen/checkpoints 2>/dev/null | grep -q step- && break; sleep 1; done
c=$(ls runs/gen/checkpoints | grep step- | head -1)
setsid nohup $DF eval --run runs/gen/checkpoints/$c --prompts data/heldout.jsonl --max-samples 100 --max-new-tokens 128 \
  --reference eval/reference.json --no-plots --out eval/gen@$c.json > eval/gen@$c.log 2>&1 < /dev/null &
echo "reference eval started on gen/$c at $(date -u +%H:%M:%S)"
sleep ${SETTLE_S:-20}
for r in runs/*.log; do echo "$r: $(tail -c 300 $r | tr '\r' '\n' | grep -v '^\s*$' | tail -1)"; done
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader; uptime
