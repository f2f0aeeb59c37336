# sourced by each call of session 15: wheels under /root/site (kept while the machine is warm)
export PYTHONPATH=/root/site:$PWD PATH=/root/site/bin:$PATH PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE  # bytecode caches: the second process on does not recompile
E=/root/ex; DF="python3 -m dflash.cli"; REPO=$PWD; S15=$REPO/docs/bench-results/2026-12-02-session15
quiet() { tr '\r' '\n' | grep -v "sample/s\]\|it/s\]\|row/s\]\|s/it\]\|step/s\]\|^\s*$"; }
steps() {  # the step-time lines of a bench/train_step.py result
python3 - "$@" <<'PY'
import json, sys
for f in sys.argv[1:]:
    d = json.load(open(f))
    for k, v in d.items():
        if k.startswith("v_") and isinstance(v, dict) and "step_ms_wall_mean" in v:
            print(f, k, "ms", v["step_ms_wall_mean"], "median", v["step_ms_median"], "mfu", v.get("mfu"),
                  "ctx_tok_s", v.get("ctx_tokens_per_s"), "peak_gib", v.get("peak_mem_gib_max"),
                  "recompiles", v.get("recompiles_after_warmup"))
PY
}
