#!/usr/bin/env bash
# The H200 benchmarks, one after another, each under its own time limit so that a hung part cannot eat
# the others; every part rewrites $OUT/<part>.json after each measurement, the summary merges them into
# $OUT/results.json and the whole output goes to $OUT/log.txt.
#
#   OUT=/tmp/benchout bash bench/run_all.sh                 # on the GPU machine (2 x H200)
#   BENCH_TINY=1 OUT=/tmp/benchout bash bench/run_all.sh    # CPU smoke run of the same code, tiny shapes
#
# BENCH_PARTS (default: the first four) picks parts, e.g. BENCH_PARTS="train_step train_scaling"; precompute_32b
# (a Qwen3-32B-shaped target), comm (NCCL all-reduce of one step's gradients, GPU topology) and balance (each
# micro-batch of an epoch timed on one GPU, the 2-process steps of each order replayed) run only when named;
# BENCH_BUDGET_S (default 560: the device tool allows 600 s a command) bounds the whole run; BENCH_WORK (default /tmp/dflash_bench) holds the
# scratch stores and runs and is deleted at the end.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
export OUT="${OUT:-/tmp/benchout}" BENCH_WORK="${BENCH_WORK:-/tmp/dflash_bench}"
mkdir -p "$OUT"
rm -rf "$BENCH_WORK"
PY="${PYTHON:-python3}"
BUDGET="${BENCH_BUDGET_S:-560}"
START=$(date +%s)

PARTS="${BENCH_PARTS:-train_step precompute loader train_scaling}"
part() {  # part NAME CAP_SECONDS script args...   (BENCH_CAP_<NAME> overrides the cap)
  local name=$1 cap=$2; shift 2
  case " $PARTS " in *" $name "*) ;; *) echo "=== $name: not in BENCH_PARTS"; return;; esac
  local override="BENCH_CAP_$name"; cap="${!override:-$cap}"
  local left=$((BUDGET - ($(date +%s) - START) - 10))
  local limit=$(( cap < left ? cap : left ))
  if [ "$limit" -lt 30 ]; then echo "=== $name: skipped, ${left}s left of the ${BUDGET}s budget"; return; fi
  echo "=== $name: limit ${limit}s ($(( $(date +%s) - START ))s into the run)"
  local t0=$(date +%s)
  BENCH_PART_LIMIT_S=$((limit - 10)) timeout -k 10 "$limit" "$PY" "$@"
  echo "=== $name: exit $? after $(( $(date +%s) - t0 ))s"
}

{
  echo "dflash bench: $(date -u +%FT%TZ) tiny=${BENCH_TINY:-0} budget=${BUDGET}s"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null || echo "no nvidia-smi"
  part train_step 170 bench/train_step.py
  part precompute 130 bench/precompute_bench.py
  part train_scaling 250 bench/loader_bench.py --part scaling
  part loader 95 bench/loader_bench.py --part loader
  part comm 60 bench/comm_probe.py
  part balance 200 bench/balance_probe.py
  part precompute_32b 200 bench/precompute_bench.py --shape qwen3-32b --name precompute_32b \
    --tokens "${BENCH_32B_TOKENS:-100000}" --passes "${BENCH_32B_PASSES:-forward forward_full capture capture_before write_bf16}"
  "$PY" bench/common.py summarize
  echo "dflash bench: done after $(( $(date +%s) - START ))s"
} 2>&1 | tee "$OUT/log.txt"
rm -rf "$BENCH_WORK"
