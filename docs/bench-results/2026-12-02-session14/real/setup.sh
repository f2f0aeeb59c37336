#!/usr/bin/env bash
# Session 14, call 3 (after two calls that copied .pieces/p1 and p2 to /root/pieces): join the GGUF, build the
# example's target, time precompute before/after the render workers, start generate in the background.
#   carry: [".pieces/p3", ".whl", ".carry"]
set -uo pipefail
[ -f /root/ex/cache/SmolLM2-135M-Instruct.Q4_1.gguf ] && mkdir -p /root/big && mv /root/ex/cache/SmolLM2-135M-Instruct.Q4_1.gguf /root/big/ || { mkdir -p /root/pieces && cp .pieces/p3/* /root/pieces/ && bash .pieces/p3/join.sh /root/pieces /root/big || exit 3; }
[ -d /root/site/zarr ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site .whl/*.whl || exit 1
. docs/bench-results/2026-12-02-session14/real/env.sh
rm -rf $E && mkdir -p $E/cache $E/data && cp -r examples/smollm2/params.yaml examples/smollm2/stages $E/
mv /root/big/SmolLM2-135M-Instruct.Q4_1.gguf $E/cache/
for f in train heldout prompts; do xz -d -c .carry/$f.jsonl.xz > $E/data/$f.jsonl; done
cd $E && python3 stages/target.py 2>&1 | quiet | grep -v Converting
python3 $REPO/bench/capture_rate.py --target $E/model --data data/train.jsonl --rows 4000 --token-budget 16384 65536 --out $OUT/rate_real.json 2>&1 | grep budgets -A0; cat $OUT/rate_real.json | tr -d '\n ' ; echo
echo "== precompute, rows rendered inline"; ( time $DF precompute --out stores/train_inline --render-workers 0 ) 2>&1 | quiet | grep "precompute:\|real"
echo "== precompute, render workers (auto)"; ( time $DF precompute ) 2>&1 | quiet | grep "precompute:\|real"
python3 - <<'PY'
import json,glob
for s in ("stores/train_inline","stores/train"):
    for f in glob.glob(f"{s}/shard-*/status.json"):
        st=json.load(open(f)); print(s, {k: st.get(k) for k in ("new_tokens","loop_s","wall_s","render_workers","gc_s")}, "loop tok/s", round(st["new_tokens"]/st["loop_s"]))
PY
setsid nohup bash -c "$DF generate > /root/gen.log 2>&1; echo GEN_DONE >> /root/gen.log" > /dev/null 2>&1 < /dev/null &
$DF precompute --data data/heldout.jsonl --out stores/heldout 2>&1 | quiet | grep "precompute:"
$DF precompute --data data/prompts.jsonl --out stores/prompts 2>&1 | quiet | grep "precompute:"
sleep 20; tr '\r' '\n' < /root/gen.log | tail -3; df -h /root | tail -1
