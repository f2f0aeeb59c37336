set -x
DF="/work/main/.venv/bin/python -m dflash.cli"
M=/work/main/examples/smollm2/model
export OMP_NUM_THREADS=2
time $DF precompute --target $M --data train.jsonl --out st --max-length 512 --gpus cpu --overwrite 2>&1 | grep "precompute:"
time $DF precompute --target $M --data heldout.jsonl --out ho --max-length 512 --gpus cpu --overwrite 2>&1 | grep "precompute:"
export OMP_NUM_THREADS=1
for cs in none rms; do
  $DF train --store st --target $M --out run_$cs --steps 200 --token-budget 2048 --num-anchors 8 --eval-every 50 --eval-store ho --context-scale $cs --overwrite --num-workers 1 > train_$cs.log 2>&1 &
done
wait
for cs in none rms; do tail -c 300 train_$cs.log; grep -o '"eval_tau": [0-9.]*' run_$cs/metrics.jsonl; done
