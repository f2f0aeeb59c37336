"""The recipe study (docs/RECIPE.md): held-out tau against training cost, one factor at a time from a
baseline, several seeds, on one or more setups (a target, its train and held-out conversations).

    python bench/recipe_study.py --setup default:data/target_model:data/train.jsonl:data/heldout.jsonl \
        [--setup b:DIR:TRAIN:HELDOUT[:BASE]] [--configs base,lr6e-4,...] [--seeds 0,1] [--parallel 8] \
        [--steps 500] [--num-workers N] [--work /tmp/recipe] [--out $OUT]

A setup may name a base (SETUP_BASES, e.g. `cli5`): train-section overrides applied to every config of that
setup before the config's own (setup c runs the CLI's defaults for real targets: block 16,
5 drafter layers, token budget = block budget 4096).  The stores' target layers follow each config's
drafter layer count (the CLI's default rule, dflash.target_model.files.default_target_layers), unless the config
names its own target_layers.

For each setup it precomputes a train and a held-out store per target-layer set the configs need (the
real `dflash precompute`), then runs the real `dflash train` for every (setup, config, seed), up to
--parallel at once on the same device (`--gpus 0` on a GPU), with `--eval-every` on the held-out store, so
metrics.jsonl holds the held-out tau curve.  Cost per run: wall seconds (shared device, see RECIPE.md),
and the drafter's training FLOPs counted from the tokens it processed (`train_flops`).  Results:
$OUT/recipe.json (one record per run, with its curve) and, with --plot, $OUT/recipe_tau_vs_flops.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from dflash.config import flat_options
from dflash.jsonl import jsonl_lines
from recipe_configs import CONFIGS, SETUP_BASES

ROOT = Path(__file__).resolve().parents[1]
BASE = flat_options(yaml.safe_load((ROOT / "params.yaml").read_text())["train"])  # nested by section there


class TimedOut(Exception):
    pass


def sh(cmd: list[str], log: Path, env: dict | None = None, timeout: float | None = None) -> float:
    """Run cmd (its own process group, killed whole at `timeout`: TimedOut); its wall seconds."""
    t = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            raise TimedOut(f"killed after {timeout:.0f}s") from None
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({rc}); see {log}:\n" + log.read_text()[-2000:])
    return time.perf_counter() - t


def dflash(*args: str) -> list[str]:
    return [sys.executable, "-m", "dflash.cli", *args]


def train_flops(cfg: dict, target: dict, ctx_tokens: float, block_tokens: float) -> float:
    """Matmul FLOPs of the drafter's training (forward + backward = 3x forward) for the tokens processed:
    fc over the context features, K/V projections of the context in every layer, the layers on the block
    tokens, attention (block queries against context and block keys, counted dense over the packed row),
    and the frozen lm_head on every block token (its backward to the hidden states only: 2x forward)."""
    H, L = target["hidden_size"], cfg["num_layers"]
    heads, kv, hd = target["num_attention_heads"], target["num_key_value_heads"], target.get("head_dim") or H // target["num_attention_heads"]
    inter, V, n_feat = target["intermediate_size"], target["vocab_size"], len(cfg["target_layers"])
    qkvo = H * heads * hd * 2 + H * kv * hd * 2
    layer = qkvo + 3 * H * inter
    fwd = 2 * ctx_tokens * (n_feat * H * H + L * H * kv * hd * 2) + 2 * block_tokens * L * layer
    lm_head = 2 * block_tokens * H * V
    return 3 * fwd + 2 * lm_head


def precompute(setup: dict, layers: list[int], work: Path, gpus: str, reuse: bool = False) -> dict:
    """Train and held-out stores of `setup` with these target layers, both precomputed at once (with `reuse`,
    those that an earlier invocation with the same --work finished are taken as they are)."""
    key = "l" + "_".join(map(str, layers))
    out = {split: work / setup["name"] / f"{split}_{key}" for split in ("train", "heldout")}
    done = work / setup["name"] / f"{key}.done"
    if reuse and done.exists():
        return out
    cmds = [dflash("precompute", "--config", str(work / "none.yaml"), "--target", setup["target"], "--data",
                   setup[split], "--out", str(store), "--gpus", gpus, "--max-length", "1024", "--compile", "off",
                   "--target-layers", ",".join(map(str, layers))) for split, store in out.items()]
    with ThreadPoolExecutor(2) as pool:  # threads only wait on the two subprocesses
        list(pool.map(lambda c: sh(c[1], work / f"{setup['name']}_{c[0]}_{key}.log"), enumerate(cmds)))
    done.write_text("")
    return out


def train_params(job: dict) -> dict:
    """The run's `dflash train` config: params.yaml's train section, the setup's base, the config's overrides."""
    extra = {"num_workers": job["num_workers"]} if job.get("num_workers") else {}
    params = {"train": {**BASE, "steps": job["steps"], **job.get("base", {}), **job["overrides"], **extra,
                        "store": str(job["stores"]["train"]),
                        "target": job["target"], "out": str(job["run"]), "gpus": job["gpus"], "seed": job["seed"],
                        "eval_store": str(job["stores"]["heldout"]), "eval_every": job["eval_every"],
                        "save_every": 0, "compile": job["compile"]}}
    params["train"].pop("target_layers", None)
    return params


def run_one(job: dict) -> dict:
    run = Path(job["run"])
    extra = {"num_workers": job["num_workers"]} if job.get("num_workers") else {}
    params = train_params(job)
    run.mkdir(parents=True, exist_ok=True)
    cfg_path = run.parent / f"{run.name}.yaml"
    cfg_path.write_text(yaml.safe_dump(params))
    partial, timeout = None, job.get("timeout")
    if job.get("end_at"):
        timeout = min(timeout or 1e9, job["end_at"] - time.time())
    try:
        wall = sh(dflash("train", "--config", str(cfg_path), "--overwrite"), run.parent / f"{run.name}.log",
                  timeout=timeout)
    except TimedOut as e:  # record the curve so far (the schedule had not ended: not a final tau)
        wall, partial = timeout, str(e)
    recs = [json.loads(line) for line in jsonl_lines((run / "metrics.jsonl").read_text())
            if line.strip().endswith("}")]
    # The step on the device's timeline (end of the previous step to end of this one: idle gaps included),
    # from its ctx tokens and rate; the median over steps after the first 10 is the steady-state step.
    step_s = sorted(r["ctx_tokens"] / r["ctx_tokens_per_s"] for r in recs[10:] if r.get("ctx_tokens_per_s"))
    curve = [(r["step"], r["eval_tau"]) for r in recs if "eval_tau" in r]
    ctx = sum(r["ctx_tokens"] for r in recs)
    # block tokens of a step = its block-token rate x its interval (the interval is ctx tokens / ctx rate)
    blk = sum(r["block_tokens_per_s"] * r["ctx_tokens"] / r["ctx_tokens_per_s"] for r in recs if r["ctx_tokens_per_s"])
    target = json.loads((Path(job["target"]) / "config.json").read_text())
    merged = {**BASE, **job.get("base", {}), **job["overrides"], "target_layers": job["layers"]}
    return {"setup": job["setup"], "config": job["name"], "seed": job["seed"], "overrides": job["overrides"],
            **({"base": job["base"]} if job.get("base") else {}), "num_workers": {**merged, **extra}["num_workers"],
            "target_layers": job["layers"],
            "heldout_tau": curve[-1][1] if curve else None, "curve": curve, "train_tau_last": recs[-1]["tau"],
            "wall_s": round(wall, 1), "ctx_tokens": ctx, "block_tokens": round(blk),
            "samples": sum(r["samples"] for r in recs), "train_flops": train_flops(merged, target, ctx, blk),
            "steps": recs[-1]["step"], "step_s_median": step_s[len(step_s) // 2] if step_s else None,
            "step_s_sum": round(sum(step_s), 2), "partial": partial, "online": online(job, run) if not partial else None}


def online(job: dict, run: Path) -> dict | None:
    """Online tau of the run's final drafter: `dflash eval --prompts` (real speculative decoding against the
    target, greedy, lossless-checked) on the setup's held-out conversations, when the job asks for it."""
    if not job.get("online"):
        return None
    out = run / "online.json"
    left = job["end_at"] - time.time() if job.get("end_at") else None
    if left is not None and left < 20:
        return {"error": "skipped: too little time left"}
    try:
        # --config: an empty one, or eval would also take params.yaml's eval.store (not there on the device:
        # an eval on the device lost its online eval to that)
        wall = sh(dflash("eval", "--config", str(run.parent.parent.parent / "none.yaml"), "--run", str(run),
                         "--prompts", job["heldout_prompts"], "--target", job["target"],
                         "--max-samples", str(job["online"]), "--out", str(out), "--no-plots",
                         "--device", "cuda:0" if job["gpus"] != "cpu:1" else "cpu"), run / "online.log", timeout=left)
    except Exception as e:  # noqa: BLE001
        return {"error": str(e)[-800:]}
    r = json.loads(out.read_text())
    return {"tau": r["online"]["tau"], "lossless": r["lossless"], "speedup": r.get("speedup"),
            "prompts": job["online"], "wall_s": round(wall, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setup", action="append", required=True, help="NAME:TARGET_DIR:TRAIN_JSONL:HELDOUT_JSONL[:BASE] "
                    "(BASE: a SETUP_BASES name, overrides for all of that setup's configs)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names (default: all); NAME@1 or "
                    "NAME@0+1 runs that config with those seeds only")
    ap.add_argument("--configs-b", default=None, help="configs for the second and later setups (default: --configs)")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--gpus", default=None, help="default: 0 when CUDA is present, else cpu:1")
    ap.add_argument("--compile", default="off")
    ap.add_argument("--num-workers", type=int, default=None, help="DataLoader workers of every run (default: the "
                    "config's; the worker count changes no batch, only the step's data wait)")
    ap.add_argument("--work", default="/tmp/recipe")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/recipe_out"))
    ap.add_argument("--plot", action="store_true")
    ap.add_argument("--reuse-stores", action="store_true", help="take the stores an earlier invocation with the same "
                    "--work finished instead of precomputing them again")
    ap.add_argument("--deadline-s", type=float, default=None, help="start no run after this many seconds")
    ap.add_argument("--run-timeout-s", type=float, default=None, help="kill a run after this many seconds (its "
                    "curve so far is kept, marked partial)")
    ap.add_argument("--online-configs", default="", help="configs whose runs also get online tau: NAME (seed 0) or "
                    "NAME@0+1 (those seeds)")
    ap.add_argument("--online-samples", type=int, default=100, help="held-out prompts of the online eval")
    ap.add_argument("--seed0-configs", default="", help="configs run with seed 0 only")
    ap.add_argument("--run-suffix", default="", help="appended to each run's directory name")
    ap.add_argument("--end-at", type=float, default=None, help="unix time: runs and online evals still going are "
                    "killed then (training curves so far kept, marked partial)")
    args = ap.parse_args()
    import torch

    gpus = args.gpus or ("0" if torch.cuda.is_available() else "cpu:1")
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    (work / "none.yaml").write_text("{}\n")
    from dflash.target_model.files import default_target_layers

    setups = []
    for i, spec in enumerate(args.setup):
        name, target, train, heldout, *base = spec.split(":")
        names = (args.configs_b or args.configs) if i else args.configs
        setups.append({"name": name, "target": target, "train": train, "heldout": heldout,
                       "base": SETUP_BASES[base[0]] if base else {},
                       "configs": [c for c in names.split(",") if c]})
    online_seeds = {}
    for item in filter(None, args.online_configs.split(",")):
        name, _, seeds = item.partition("@")
        online_seeds[name] = [int(x) for x in seeds.split("+")] if seeds else [0]
    jobs, t0, stores_of = [], time.perf_counter(), {}

    def layers_of(s: dict, c: str) -> list[int]:
        n_target = json.loads((Path(s["target"]) / "config.json").read_text())["num_hidden_layers"]
        n_draft = {**BASE, **s["base"], **CONFIGS[c]}["num_layers"]
        return CONFIGS[c].get("target_layers") or default_target_layers(n_target, n_draft)

    need = {(s["name"], tuple(layers_of(s, item.partition("@")[0]))): s for s in setups for item in s["configs"]}

    def make_stores(key):  # every (setup, layer set) at once: each is its own two subprocesses
        stores_of[key] = precompute(need[key], list(key[1]), work, "0" if gpus != "cpu:1" else "cpu", args.reuse_stores)
        print(f"stores {key[0]} {list(key[1])} after {time.perf_counter() - t0:.0f}s", flush=True)

    with ThreadPoolExecutor(max(1, len(need))) as pool:
        list(pool.map(make_stores, need))
    for s in setups:
        for item in s["configs"]:
            c, _, only = item.partition("@")
            layers = layers_of(s, c)
            stores = stores_of[s["name"], tuple(layers)]
            seeds = [int(x) for x in args.seeds.split(",")][: 1 if c in args.seed0_configs.split(",") else None]
            for seed in [int(x) for x in only.split("+")] if only else seeds:
                jobs.append({"setup": s["name"], "name": c, "overrides": CONFIGS[c], "base": s["base"],
                             "num_workers": args.num_workers, "seed": seed, "layers": layers,
                             "stores": stores, "target": s["target"], "gpus": gpus, "steps": args.steps,
                             "eval_every": args.eval_every, "compile": args.compile,
                             "run": str(work / s["name"] / "runs" / f"{c}_s{seed}{args.run_suffix}"),
                             "timeout": args.run_timeout_s,
                             "end_at": args.end_at,
                             "heldout_prompts": s["heldout"],
                             "online": args.online_samples if seed in online_seeds.get(c, ()) else None})
    print(f"precompute done in {time.perf_counter() - t0:.0f}s; {len(jobs)} runs", flush=True)
    results = []

    def one(job):
        if (args.deadline_s and time.perf_counter() - t0 > args.deadline_s) or (args.end_at and
                                                                                 args.end_at - time.time() < 30):
            print(json.dumps({"skipped": f"{job['setup']} {job['name']} s{job['seed']}"}), flush=True)
            return None
        try:
            r = run_one(job)
        except Exception as e:  # noqa: BLE001  (a failed run is recorded, the study goes on)
            r = {"setup": job["setup"], "config": job["name"], "seed": job["seed"], "error": str(e)[-1500:]}
        print(json.dumps({k: v for k, v in r.items() if k != "curve"}), flush=True)
        results.append(r)
        (out / "recipe.json").write_text(json.dumps({"runs": results, "device": torch.cuda.get_device_name(0)
                                                     if torch.cuda.is_available() else "cpu",
                                                     "parallel": args.parallel, "steps": args.steps}, indent=1))
        return r

    with ThreadPoolExecutor(args.parallel) as pool:  # threads only wait on subprocesses here
        list(pool.map(one, jobs))
    print(f"study done in {time.perf_counter() - t0:.0f}s", flush=True)
    if args.plot:
        plot(results, out / "recipe_tau_vs_flops.png")


def shape_of(overrides: dict, base: dict | None = None) -> tuple:
    """What a step's time depends on (not lr, betas, ...): anchors, token and block budgets, accumulation, rows,
    block size and drafter layers (`base`: the setup's base overrides, as recorded in the run's record).
    Not the target's width: timings of one setup's shapes are meant for that setup's runs."""
    c = {**BASE, **(base or {}), **overrides}
    return (c["num_anchors"], c["token_budget"], c.get("block_budget") or c["token_budget"], c.get("grad_accum", 1),
            c.get("rows_per_batch", 1), c["block_size"], c["num_layers"])


def step_seconds(timing_files: list[str]) -> dict:
    """{shape: steady-state seconds per step} from runs measured alone on the device (--parallel 1)."""
    out = {}
    for f in timing_files:
        for r in json.loads(Path(f).read_text())["runs"]:
            if r and r.get("step_s_median"):
                out[shape_of(r["overrides"], r.get("base"))] = r["step_s_median"]
    return out


def plot(results: list[dict], path: Path, step_s: dict | None = None) -> None:
    """Held-out tau against training FLOPs, per setup: every run's curve (its --eval-every points, FLOPs
    taken proportional to the step), one colour per config, both seeds.  With `step_s` ({shape: seconds
    per step measured alone}), against GPU-seconds instead: step x its shape's seconds per step (runs
    whose shape was not timed are left out); with step_s "own", step x the run's own step_s_median (runs
    that ran alone, one after another)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setups = sorted({r["setup"] for r in results if r.get("heldout_tau") is not None})
    fig, axes = plt.subplots(1, len(setups), figsize=(7.5 * len(setups), 5.5), squeeze=False)
    for ax, s in zip(axes[0], setups):
        rs = [r for r in results if r.get("setup") == s and r.get("heldout_tau") is not None]
        configs = sorted({r["config"] for r in rs})
        colours = plt.cm.tab20(range(len(configs)))
        for colour, c in zip(colours, configs):
            for i, r in enumerate(x for x in rs if x["config"] == c):
                steps, taus = zip(*r["curve"])
                if step_s is None:
                    xs = [r["train_flops"] * st / r["steps"] / 1e12 for st in steps]
                elif step_s == "own":  # the run's own steady-state step (it ran alone on the device)
                    if not r.get("step_s_median"):
                        continue
                    xs = [st * r["step_s_median"] for st in steps]
                elif shape_of(r.get("overrides") or {}, r.get("base")) in step_s:
                    xs = [st * step_s[shape_of(r.get("overrides") or {}, r.get("base"))] for st in steps]
                else:
                    continue
                ax.plot(xs, taus, "-o", ms=2.5, lw=1, color=colour, label=c if i == 0 else None)
        ax.set_xlabel("drafter training TFLOPs" if step_s is None else
                      "H200 GPU-seconds (steady-state step measured alone x steps)")
        ax.set_ylabel("held-out tau (offline)")
        ax.set_title(f"setup {s}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_files(files: list[str], path: str, timing: list[str] | str | None = None) -> None:
    """python bench/recipe_study.py --plot-from A.json B.json ... OUT.png
    python bench/recipe_study.py --plot-gpu-s-from TIMING.json A.json B.json ... OUT.png
    python bench/recipe_study.py --plot-own-gpu-s-from A.json ... OUT.png  (each run's own seconds per step)
    (RECIPE_PLOT_ONLY=base,peer,... keeps those configs only)"""
    runs = load_runs(files)
    if os.environ.get("RECIPE_PLOT_ONLY"):  # comma-separated config names (as relabelled by load_runs)
        runs = [r for r in runs if r["config"] in os.environ["RECIPE_PLOT_ONLY"].split(",")]
    plot(runs, Path(path), "own" if timing == "own" else step_seconds(timing) if timing else None)


def load_runs(files: list[str]) -> list[dict]:
    """The runs of recipe.json files, each tagged with the file it came from (`source`, the file's stem), so
    that one config measured by two studies stays two rows.  A run records its own overrides and lr; a config
    name means what recipe_configs.py says it means when the run was made, so compare across files by the
    recorded overrides, not by name."""
    runs = []
    for f in files:
        for r in json.loads(Path(f).read_text())["runs"]:
            if r:
                runs.append({**r, "source": Path(f).stem})
    return runs


def summary(files: list[str]) -> None:
    """python bench/recipe_study.py --summary-from A.json ...: one markdown row per (setup, config): held-out
    tau per seed and mean, steps, TFLOPs, samples, online tau (each seed that has one), steady-state s/step."""
    rows: dict = {}
    for r in load_runs(files):
        if "error" not in r:
            rows.setdefault((r["setup"], r["config"], r["source"]), []).append(r)
    print("| setup | config | file | steps | held-out tau (s0 / s1) | mean | train TFLOPs | samples | online tau "
          "| s/step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (setup, config, source), rs in sorted(rows.items()):
        rs = sorted(rs, key=lambda r: r["seed"])
        taus = [r["heldout_tau"] for r in rs if r.get("heldout_tau") is not None and not r.get("partial")]
        ons = [(r["seed"], r["online"]) for r in rs if r.get("online") and "tau" in r["online"]]
        part = " (partial: " + ", ".join(f"s{r['seed']} at step {r['steps']}" for r in rs if r.get("partial")) + ")" \
            if any(r.get("partial") for r in rs) else ""
        tau_s = f"{' / '.join(f'{t:.2f}' for t in taus)} | {sum(taus) / len(taus):.2f}" if taus else "- | -"
        st = rs[0].get("step_s_median")
        on_s = " / ".join(f"s{seed} {o['tau']:.2f}" + ("" if o["lossless"] else " NOT LOSSLESS") for seed, o in ons) or "-"
        st_s = f"{st * 1e3:.1f} ms" if st else "-"
        print(f"| {setup} | {config}{part} | {source} | {rs[0]['steps']} | {tau_s} | {rs[0]['train_flops'] / 1e12:.1f} | "
              f"{rs[0]['samples']} | {on_s} | {st_s} |")

if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--summary-from":
        summary(sys.argv[2:])
    elif len(sys.argv) > 2 and sys.argv[1] == "--plot-from":
        plot_files(sys.argv[2:-1], sys.argv[-1])
    elif len(sys.argv) > 3 and sys.argv[1] == "--plot-gpu-s-from":
        plot_files(sys.argv[3:-1], sys.argv[-1], [sys.argv[2]])
    elif len(sys.argv) > 3 and sys.argv[1] == "--plot-own-gpu-s-from":
        plot_files(sys.argv[2:-1], sys.argv[-1], "own")
    else:
        main()
