#!/usr/bin/env bash
# Session 35: `dflash generate --batch-tokens` on a GPU, with the static cache and transformers' compiled
# decode step (the CPU tests cannot compile it): the embedded target answers 96 first exchanges, 32 of
# them padded to ~100-1,900 tokens, once at the default budget (16 rows a batch at every width) and once at
# 3,000 positions (fewer rows at the wide widths). Both must finish and give the same greedy replies (fp32).
# Carry .whl (datasets for load_rows). Prints the recompiles Dynamo logs and each run's summary.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
python3 - <<'PY'
import json
rows = [json.loads(x) for x in open("data/train.jsonl")][:96]
with open("/tmp/prompts.jsonl", "w") as f:
    for i, r in enumerate(rows):
        msgs = r["messages"][:2]
        if i % 3 == 0:  # long prompts: widths 512, 1024 and 2048 (the context) in the static cache
            msgs = [{**msgs[0], "content": (msgs[0]["content"] + " ") * (6 + 3 * (i % 24))}, msgs[1]]
        f.write(json.dumps({"id": f"r{i}", "messages": msgs}) + "\n")
PY
for bt in 262144 3000; do
  TORCH_LOGS=recompiles python3 -m dflash.cli generate --target data/target_model --data /tmp/prompts.jsonl \
    --out /tmp/out_$bt.jsonl --turns last --max-new-tokens 48 --batch-size 16 --batch-tokens $bt \
    --static-cache on --gpus 0 --dtype fp32 2>&1 | tr '\r' '\n' | grep -v "^generate: *[0-9]*%" | tail -8
done
python3 - <<'PY'
import json
a = [json.loads(x) for x in open("/tmp/out_262144.jsonl")]
b = [json.loads(x) for x in open("/tmp/out_3000.jsonl")]
same = sum(x == y for x, y in zip(a, b))
print(f"rows {len(a)} / {len(b)}; identical rows {same}")
PY
