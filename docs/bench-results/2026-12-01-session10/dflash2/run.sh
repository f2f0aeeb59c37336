#!/usr/bin/env bash
# Session 10, one H200 call (<= 360 s), issue 22 item 4:
#  1. the embedded default (params.yaml's train section: 500 steps, 2 layers, block 8), four drafters trained
#     at the same budget, side by side on the GPU (compile off, as the recipe study runs them):
#     dflash / ce, dflash / dpace, dflash2 / ce, dflash2 / dpace; then held-out tau on the held-out store and
#     online tau (16 held-out prompts, fp32, lossless check) of each;
#  2. alone on the GPU: bench/train_step.py at the Qwen3-8B shape (5 layers, block 16, 4 packed rows of
#     4096 + 4096 tokens), --arch dflash and --arch dflash2.
# SMOKE=1 runs the same on CPU with tiny budgets (a check of this script before the call).
set -u
export PYTHONUNBUFFERED=1
if [ -z "${SMOKE:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
  GPUS=0; STEPS=${STEPS:-500}; ONLINE=16; PY=python3
else
  GPUS=cpu; STEPS=3; ONLINE=1; PY=python
  export PYTHONPATH=$PWD
fi
OUT=${OUT:-/tmp/d2out}; W=${W:-/tmp/d2w}; mkdir -p $OUT $W/logs
T0=$(date +%s); el() { echo "t=$(( $(date +%s) - T0 ))s $*"; }
date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null; nproc
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
D="$PY -m dflash.cli"
TRAIN_DATA=data/train.jsonl
[ -n "${SMOKE:-}" ] && { head -40 data/train.jsonl > $W/train.jsonl; head -6 data/heldout.jsonl > $W/heldout.jsonl; TRAIN_DATA=$W/train.jsonl; }
HELD=${SMOKE:+$W/heldout.jsonl}; HELD=${HELD:-data/heldout.jsonl}
# data/generated/train.jsonl is data/train.jsonl (generate.turns: none)
$D precompute --config params.yaml --gpus $GPUS --data $TRAIN_DATA --out $W/stores/train --overwrite > $W/logs/pre_train.log 2>&1 &
$D precompute --config params.yaml --gpus $GPUS --data $HELD --out $W/stores/heldout --overwrite > $W/logs/pre_held.log 2>&1 &
wait; el "precompute done"; tail -n 1 $W/logs/pre_train.log $W/logs/pre_held.log
RUNS="dflash-ce:dflash:ce dflash-dpace:dflash:dpace dflash2-ce:dflash2:ce dflash2-dpace:dflash2:dpace"
for r in $RUNS; do IFS=: read name arch loss <<< "$r"
  $D train --config params.yaml --store $W/stores/train --eval-store $W/stores/heldout --eval-every 0 --gpus $GPUS \
    --compile off --steps $STEPS --arch $arch --loss $loss --out $W/runs/$name --overwrite > $W/logs/train_$name.log 2>&1 &
done
wait; el "training done"
for r in $RUNS; do IFS=: read name arch loss <<< "$r"; tail -c 300 $W/logs/train_$name.log; echo; done
for r in $RUNS; do IFS=: read name arch loss <<< "$r"
  $D eval --config params.yaml --run $W/runs/$name --store $W/stores/heldout --no-plots --out $W/eval/$name/offline.json > $W/logs/eval_$name.log 2>&1 &
  $D eval --config params.yaml --run $W/runs/$name --store $W/stores/heldout --prompts $HELD --target data/target \
    --max-samples $ONLINE --no-plots --out $W/eval/$name/online.json > $W/logs/online_$name.log 2>&1 &
done
wait; el "evals done"
$PY - "$W" "$OUT" <<'PY'
import json, sys, pathlib
w, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
rows = {}
for run in sorted((w / "runs").iterdir()):
    r = {"train": json.loads((run / "metrics.json").read_text()) if (run / "metrics.json").exists() else None}
    for kind in ("offline", "online"):  # separate commands: a failing online eval keeps the held-out tau
        p = w / "eval" / run.name / f"{kind}.json"
        r[kind] = json.loads(p.read_text()) if p.exists() else None
    rows[run.name] = r
    e, t = r["online"] or {}, r["train"] or {}
    print(run.name, "heldout tau", (r["offline"] or {}).get("tau"), "online tau", (e.get("online") or {}).get("tau"),
          "lossless", e.get("lossless"), "speedup", e.get("speedup"), "train loss", t.get("loss"), "train tau", t.get("tau"),
          "ctx tok/s", t.get("tokens_per_s"))
(out / "tau_summary.json").write_text(json.dumps(rows, indent=1))
PY
tar czf $OUT/runs.tgz --exclude=checkpoints --exclude=tb --exclude="*.safetensors" -C $W runs eval logs 2>/dev/null
el "tau part done"
# 2. the step at the Qwen3-8B shape, alone on the GPU
TINY=${SMOKE:+--tiny}
for arch in dflash dflash2; do
  left=$(( ${END_S:-345} - ($(date +%s) - T0) ))
  [ $left -lt 40 ] && { el "no time left for the $arch step"; continue; }
  lim=$left; [ "$arch" = dflash ] && lim=$(( left / 2 ))
  BENCH_PART_LIMIT_S=$lim timeout $lim $PY bench/train_step.py $TINY --arch $arch --rows-only --rows 4 > $W/logs/step_$arch.log 2>&1
  el "step $arch: exit $?"; grep -h '"rows4"\|rows4:' $W/logs/step_$arch.log | cut -c1-400
done
cp $W/logs/step_*.log $OUT/ 2>/dev/null
el "end"
