#!/usr/bin/env bash
# Session 18 (issue 33, "the house"): the training step before and after, with TrainStep reading the loss
# kernel from its config at every step again (step-regress).  Session 17's "after" timed torch's compiled
# loss, not the Triton one: TrainStep fixed its kernel at build, before bench/train_step.py set
# loss_kernel=triton for the variant (STEP_FINDINGS.md).
#
#   bash docs/bench-results/2026-12-03-session18/bench33.sh [RESULTS_DIR]      # from the repository root
#
# Before = `git archive 10821d2 dflash bench`, unpacked by the caller at .carry/old; after = this tree.
# bench/train_step.py --layers 3 --steps 10, Qwen3-8B shape, compile on, Triton loss, 1 and 16 packed rows,
# twice each (rep a: old first, rep b: now first).  If time is left, one control run: this tree with the
# compiled torch loss at 16 rows (it should give session 17's "after": ~700 ms, ~47.42 GiB).
# Needs torch, transformers (numpy, pyyaml, tqdm), triton; ~2-4 minutes on an H200.
set -u
RES=${1:-/root/b33}
ROOT=$PWD
OLD=${TMPDIR:-/tmp}/b33_old
DEADLINE_S=${B33_DEADLINE_S:-230}
[ -f .carry/old/bench/train_step.py ] || { echo "no .carry/old/bench/train_step.py (git archive 10821d2 dflash bench)"; exit 2; }
rm -rf "$OLD" && mkdir -p "$OLD" "$RES" && tar -C .carry/old -cf - . | tar -C "$OLD" -xf - || exit 2
export PYTHONUNBUFFERED=1 BENCH_ROWS_ONLY=1 BENCH_ROWS= BENCH_PART_LIMIT_S=300  # the bench's own estimate (60 + 5 R s) would skip R=16 under 200
unset PYTHONDONTWRITEBYTECODE
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__,
'triton', triton.__version__, torch.cuda.get_device_name())" || exit 3
T0=$SECONDS

one() {  # one <name> <tree> <rows> <loss kernel> [the seconds it needs left, 25]
  local name=$1 dir=$2 rows=$3 loss=$4 need=${5:-25} left=$((DEADLINE_S - (SECONDS - T0)))
  if [ $left -lt $need ]; then echo "$(date +%T) $name: skipped (time)"; return; fi
  [ $left -gt 150 ] && left=150
  local d=$RES/$name; mkdir -p "$d"
  ( cd "$dir" && OUT=$d PYTHONPATH=$dir BENCH_VARIANTS="R=$rows,loss=$loss" \
      timeout $left python3 bench/train_step.py --layers 3 --steps 10 > "$d/log.txt" 2>&1 )
  echo "$(date +%T) $name: exit $? ($((SECONDS - T0)) s)"
}

for rep in a b; do
  for rows in 1 16; do
    if [ $rep = a ]; then order="old now"; else order="now old"; fi
    for which in $order; do
      if [ $which = old ]; then dir=$OLD; else dir=$ROOT; fi
      one ${which}_r${rows}_$rep "$dir" $rows triton
    done
  done
done
one ctl_compiled_r16 "$ROOT" 16 compiled 60

python3 - "$RES" <<'PY'
import json, pathlib, sys
res = pathlib.Path(sys.argv[1])
rows = []
for d in sorted(p for p in res.iterdir() if p.is_dir()):
    f = d / "train_step.json"
    data = json.loads(f.read_text()) if f.exists() else {}
    for k, v in data.items():
        if k.startswith("v_R") and not k.endswith(("_config", "_build_s")) and isinstance(v, dict):
            rows.append((d.name, k, v.get("step_ms_wall_mean"), v.get("step_ms_median"), v.get("peak_mem_gib_max"),
                         v.get("mfu"), v.get("recompiles_after_warmup"), v.get("error") or v.get("skipped") or ""))
    if not any(r[0] == d.name for r in rows):
        rows.append((d.name, "-", None, None, None, None, None, "no result: see log.txt"))
    if f.exists():
        (res / f"{d.name}.json").write_text(f.read_text())
print(f"{'run':<18} {'variant':<20} {'ms mean':>8} {'ms med':>8} {'peak GiB':>9} {'MFU':>6} {'recomp':>6}  note")
for r in rows:
    cells = [("" if x is None else f"{x:.2f}" if isinstance(x, float) else str(x)) for x in r[2:7]]
    print(f"{r[0]:<18} {r[1]:<20} {cells[0]:>8} {cells[1]:>8} {cells[2]:>9} {cells[3]:>6} {cells[4]:>6}  {r[7]}")
PY
echo "$(date +%T) bench33 done in $((SECONDS - T0)) s; results in $RES"
