#!/bin/bash
# the regenerated arm of the measurement (the original arm is the pipeline's own run: CI's dvc repro)
set -x
cd /tmp/gen_meas/code2
. /work/main/.venv/bin/activate
export PYTHONPATH=/tmp/gen_meas/code2
D=/tmp/gen_meas
date -Is
python -m dflash.cli verify $D/stores/heldout --quick && python -m dflash.cli verify $D/stores/heldout_regen --quick
python -m dflash.cli precompute --config params.yaml --gpus cpu --data $D/train.jsonl --out $D/stores/train_regen
python -m dflash.cli train --config params.yaml --store $D/stores/train_regen --out $D/runs/regen --eval-store $D/stores/heldout --overwrite
python -m dflash.cli eval --config params.yaml --run $D/runs/regen --store $D/stores/heldout --out $D/runs/regen/eval_heldout.json --no-plots
python -m dflash.cli eval --config params.yaml --run $D/runs/regen --store $D/stores/heldout_regen --out $D/runs/regen/eval_heldout_regen.json --no-plots
python -m dflash.cli eval --config params.yaml --run $D/runs/regen --prompts data/heldout.jsonl --target data/target --max-samples 16 --out $D/runs/regen/eval_online.json --no-plots
date -Is
echo MEAS_DONE
