#!/usr/bin/env bash
# CPU fallback of run.sh's tau part (issue 22 item 4), after the H200 evals crashed: the four drafters at
# 100 steps (a fifth of params.yaml's budget; everything else params.yaml's) on the pipeline's own stores
# (stores/train, stores/heldout of `dvc repro`), then held-out tau and online tau (16 prompts, fp32).
# Two runs at a time, niced, one thread each, on the 2-core development machine shared with other work.
set -u
W=${W:-/tmp/d2/cpu}; mkdir -p $W/logs; export OMP_NUM_THREADS=1
run() { name=$1 arch=$2 loss=$3
  nice -n 10 python -m dflash.cli train --config params.yaml --store stores/train --eval-every 0 --gpus cpu:1 --steps 100 \
    --arch $arch --loss $loss --out $W/runs/$name --overwrite > $W/logs/train_$name.log 2>&1
  nice -n 10 python -m dflash.cli eval --config params.yaml --run $W/runs/$name --store stores/heldout --no-plots \
    --out $W/eval/$name/offline.json > $W/logs/eval_$name.log 2>&1
  nice -n 10 python -m dflash.cli eval --config params.yaml --run $W/runs/$name --store stores/heldout \
    --prompts data/heldout.jsonl --target data/target --max-samples 16 --no-plots --out $W/eval/$name/online.json \
    > $W/logs/online_$name.log 2>&1
}
( run dflash-ce dflash ce; run dflash-dpace dflash dpace ) &
( run dflash2-ce dflash2 ce; run dflash2-dpace dflash2 dpace ) &
wait
