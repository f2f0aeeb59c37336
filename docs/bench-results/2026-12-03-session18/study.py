"""Session 18's study driver on the real target (SmolLM2-135M-Instruct, ShareGPT), on one H200.

In /root/ex (examples/smollm2 laid out by c3.sh), one process that runs the example's own commands and logs
each with its time (study.log), every training run in its own process session:
  1. the target stage;
  2. the ShareGPT store of the 4K training conversations with the final hidden state, alone (the capture
     rate); then at once: `dflash generate` (GEN_GPUS workers) of the first exchanges of the 193 held-out
     and 3,870 training conversations (data/gen_prompts.jsonl), and a 1-step run with the target-only
     reference of the online eval (eval --reference);
  3. the stores of the regenerated replies: G (training, with the final hidden state), G2k (its first
     2,000 samples) and HG (the held-out replies: the offline curve every run is measured on);
  4. `long` (the candidate default) alone for SOLO_S seconds: its step time alone, the GPU-minutes unit;
  5. the screen: each run one change from `g` (the CLI's defaults, 8 packed rows a step, on G), all sharing
     the GPU with `long`, held-out tau on HG every 100 steps;
  6. online evals (100 held-out prompts x 128 new tokens, lossless-checked, EVAL_WORKERS processes each,
     the shared reference) of each screen run's last checkpoint and of long's LONG_EVAL_STEPS.
`python3 study.py collect` prints the summary (study.json).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

E = Path(os.environ.get("STUDY_DIR", "/root/ex"))
DF = [sys.executable, "-m", "dflash.cli"]
SCREEN_STEPS = int(os.environ.get("SCREEN_STEPS", 400))
LONG_STEPS = int(os.environ.get("LONG_STEPS", 4000))
EVALS = int(os.environ.get("EVALS", 3))
EVAL_WORKERS = os.environ.get("EVAL_WORKERS", "4")
SOLO_S = float(os.environ.get("SOLO_S", 75))
GPUS = os.environ.get("GPUS", "0")  # cpu:1 / cpu for a CPU dry run of the driver
GEN_GPUS = os.environ.get("GEN_GPUS", ",".join(["0"] * 8))
GEN_ARGS = os.environ.get("GEN_ARGS", "--batch-size 128 --max-new-tokens 384").split()
PRE_ARGS = os.environ.get("PRE_ARGS", "").split()  # e.g. --gpus cpu --render-workers 0 for the dry run
EVAL_ARGS = os.environ.get("EVAL_ARGS", "--max-samples 100 --max-new-tokens 128").split()
COMMON = ["--gpus", GPUS, "--num-workers", "1", "--overwrite"]
EVERY = ["--save-every", "100", "--eval-every", "100", "--eval-store", "stores/heldout_gen"]
R8 = ["--rows-per-batch", os.environ.get("ROWS", "8")]
# name: (store, steps, flags): one change from g, the CLI's defaults with 8 packed rows a step on the
# regenerated store.
RUNS = {
    "g": ("gen", SCREEN_STEPS, R8),
    "g_s1": ("gen", SCREEN_STEPS, R8 + ["--seed", "1"]),
    "s": ("train", SCREEN_STEPS, R8),
    "g_lr2e-3": ("gen", SCREEN_STEPS, R8 + ["--lr", "2e-3"]),
    "g_init": ("gen", SCREEN_STEPS, R8 + ["--drafter-init", "target"]),
    "g_kd": ("gen", SCREEN_STEPS, R8 + ["--kd-weight", "1.0"]),
    "g_a32": ("gen", SCREEN_STEPS, R8 + ["--num-anchors", "32"]),
    "g_b8": ("gen", SCREEN_STEPS, R8 + ["--block-size", "8"]),
    "g_l5": ("gen", SCREEN_STEPS, R8 + ["--num-layers", "5"]),
    "g_d2p": ("gen", SCREEN_STEPS, R8 + ["--arch", "dflash2", "--loss", "dpace"]),
    "g_dspark": ("gen", SCREEN_STEPS, R8 + ["--arch", "dspark"]),
    "g_dspark_topk": ("gen", SCREEN_STEPS, R8 + ["--arch", "dspark", "--tv-source", "topk"]),
    "g_2k": ("gen2k", SCREEN_STEPS, R8),
}
ONLY = os.environ.get("RUNS")
if ONLY:
    RUNS = {k: v for k, v in RUNS.items() if k in ONLY.split(",")}
LONG = ("gen", LONG_STEPS, R8 + ["--keep-checkpoints", "40"], ["--save-every", "250", "--eval-every", "250",
                                                                "--eval-store", "stores/heldout_gen"])
LONG_EVAL_STEPS = tuple(int(x) for x in os.environ.get("LONG_EVAL_STEPS", "500,1000,2000,3000,4000").split(","))


def log(msg: str) -> None:
    with open(E / "study.log", "a") as f:
        f.write(time.strftime("%H:%M:%S ", time.gmtime()) + msg + "\n")


def run(name: str, cmd: list[str], timeout: float | None = None) -> int:
    t = time.time()
    with open(E / "logs" / f"{name}.log", "w") as out:
        try:
            rc = subprocess.run(cmd, cwd=E, stdout=out, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    log(f"{name}: exit {rc} in {time.time() - t:.1f} s")
    return rc


def bg(name: str, cmd: list[str]) -> subprocess.Popen:
    log(f"{name}: started")
    out = open(E / "logs" / f"{name}.log", "w")
    return subprocess.Popen(cmd, cwd=E, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)


def train_cmd(name: str, store: str, steps: int, flags: list[str], every: list[str] = EVERY) -> list[str]:
    return DF + ["train", "--store", f"stores/{store}", "--out", f"runs/{name}", "--steps", str(steps)] + COMMON + every + flags


def checkpoints(name: str) -> list[Path]:
    return sorted((E / "runs" / name / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))


def eval_cmd(name: str, ck: Path) -> list[str]:
    return DF + ["eval", "--run", str(ck), "--workers", EVAL_WORKERS, "--prompts", "data/heldout.jsonl",
                 "--reference", "eval/reference.json", "--no-plots", "--out", f"eval/{name}@{ck.name}.json"] + EVAL_ARGS


def split_generated() -> tuple[int, int]:
    """generate's output holds both sets; the held-out ids go to heldout_gen.jsonl, the rest to generated.jsonl."""
    held = {json.loads(x)["id"] for x in (E / "data/heldout.jsonl").read_text(encoding="utf-8").split("\n") if x.strip()}
    n = [0, 0]
    with open(E / "data/generated.jsonl", "w", encoding="utf-8") as g, \
            open(E / "data/heldout_gen.jsonl", "w", encoding="utf-8") as h:
        for line in (E / "data/gen_all.jsonl").read_text(encoding="utf-8").split("\n"):
            if line.strip():
                is_held = json.loads(line)["id"] in held
                (h if is_held else g).write(line + "\n")
                n[is_held] += 1
    return n[0], n[1]


def last_step(name: str) -> int:
    p = E / "runs" / name / "metrics.jsonl"
    if not p.is_file():
        return 0
    rows = [x for x in p.read_text().split("\n") if x.strip()]
    for x in reversed(rows):
        r = json.loads(x)
        if "tau" in r:
            return int(r["step"])
    return 0


def drive() -> None:
    (E / "logs").mkdir(exist_ok=True)
    (E / "eval").mkdir(exist_ok=True)
    log(f"driver: screen {SCREEN_STEPS} steps ({','.join(RUNS)}), long {LONG_STEPS}, evals {EVALS} x {EVAL_WORKERS} workers")
    if not (E / "model/config.json").exists() and run("target", [sys.executable, "stages/target.py"], 300):
        return log("driver: the target stage failed; stopping")
    wait = Path(os.environ.get("WAIT_FOR", "/root/b33/bench33.out"))  # the step bench (c1.sh) has the GPU first
    for _ in range(60):
        if not wait.is_file() or "bench33 done" in wait.read_text():
            break
        time.sleep(5)
    log("driver: the GPU is free")
    # the ShareGPT store alone on the GPU: the CLI's capture rate on the real target (issue 32, item 3)
    if run("precompute_train", DF + ["precompute", "--final-hidden"] + PRE_ARGS, 400):
        return log("driver: precompute failed; stopping")
    gen = bg("generate", DF + ["generate", "--data", "data/gen_prompts.jsonl", "--out", "data/gen_all.jsonl",
                               "--gpus", GEN_GPUS] + GEN_ARGS)
    # beside generate: a 1-step run and the target-only reference of the online eval
    ref = None
    if not os.environ.get("SKIP_REF") and run("train_ref", train_cmd("ref", "train", 1, R8, ["--eval-every", "0"]), 300) == 0 and checkpoints("ref"):
        ref = bg("eval_ref", eval_cmd("ref", checkpoints("ref")[-1]))
    gen.wait()
    log(f"generate: exit {gen.returncode}")
    if gen.returncode != 0:
        return log("driver: generate failed; stopping")
    n_train, n_held = split_generated()
    log(f"generated: {n_train} training, {n_held} held-out samples")
    for name, data, extra in (("gen", "data/generated.jsonl", ["--final-hidden"]),
                              ("heldout_gen", "data/heldout_gen.jsonl", ["--final-hidden"]),
                              ("gen2k", "data/generated.jsonl", ["--max-samples", "2000"])):
        if run(f"precompute_{name}", DF + ["precompute", "--data", data, "--out", f"stores/{name}"] + extra + PRE_ARGS, 400):
            return log(f"driver: precompute {name} failed; stopping")
    procs = {"long": bg("train_long", train_cmd("long", *LONG))}
    t0 = time.time()
    while time.time() - t0 < SOLO_S and procs["long"].poll() is None:
        time.sleep(2)
    log(f"long alone for {time.time() - t0:.0f} s: step {last_step('long')}")
    procs.update({name: bg(f"train_{name}", train_cmd(name, *spec)) for name, spec in RUNS.items()})
    queue, queued, evals, ended = [], set(), {}, set()
    if ref is not None:
        evals[("ref", "reference")] = ref
    while True:
        for name, p in procs.items():
            if p.poll() is not None and name not in ended:
                ended.add(name)
                log(f"train_{name}: exit {p.returncode} at step {last_step(name)}")
            cks = checkpoints(name)
            wanted = [cks[-1]] if p.poll() is not None and cks else []
            if name == "long":
                wanted += [c for c in cks if int(c.name.split("-")[1]) in LONG_EVAL_STEPS]
            for c in wanted:
                if (name, c.name) not in queued:
                    queued.add((name, c.name))
                    queue.append((name, c))
        for key in [k for k, p in evals.items() if p.poll() is not None]:
            log(f"eval {key[0]}@{key[1]}: exit {evals.pop(key).returncode}")
        # screen runs' evals first; long's only once the screen is over (the screen's CPU is the bound)
        queue.sort(key=lambda x: x[0] == "long")
        screen_alive = any(p.poll() is None for n, p in procs.items() if n != "long")
        while queue and len(evals) < EVALS and (E / "eval/reference.json").exists() \
                and not (queue[0][0] == "long" and screen_alive):
            name, c = queue.pop(0)
            evals[(name, c.name)] = bg(f"eval_{name}@{c.name}", eval_cmd(name, c))
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip() if GPUS.isdigit() else ""
        alive = [n for n, p in procs.items() if p.poll() is None]
        with open(E / "progress.log", "a") as f:  # time, runs alive, evals alive, GPU, each run's step
            f.write(json.dumps({"t": round(time.time(), 1), "alive": alive, "evals": len(evals), "gpu": gpu,
                                "steps": {n: last_step(n) for n in procs}}) + "\n")
        if not alive and not queue and not evals:
            break
        if os.environ.get("STOP_AT") and time.time() > float(os.environ["STOP_AT"]):
            break
        time.sleep(5)
    log("driver: done")


def rows_of(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().split("\n") if x.strip()] if path.is_file() else []


def step_s(rows: list[dict], skip: int = 20, upto: int | None = None) -> float | None:
    """Seconds per step on the device's timeline, from the trainer's own per-step token rates."""
    xs = [r["ctx_tokens"] / r["ctx_tokens_per_s"] for r in rows[skip:upto] if r.get("ctx_tokens_per_s")]
    return sum(xs) / len(xs) if xs else None


def fair_share_minutes() -> dict:
    """Each run's GPU-minutes at each step it passed, as a fair share: the wall time it ran over the number of
    training runs alive (evals not counted), integrated from progress.log."""
    out: dict = {}
    prev = None
    for r in rows_of(E / "progress.log"):
        if prev is not None and r["alive"]:
            dt = (r["t"] - prev["t"]) / 60 / len(r["alive"])
            for n in r["alive"]:
                acc = out.setdefault(n, {"minutes": 0.0, "at": []})
                acc["minutes"] += dt
                acc["at"].append((r["steps"].get(n, 0), round(acc["minutes"], 3)))
        prev = r
    return out


def collect() -> dict:
    out: dict = {"runs": {}, "evals": {}}
    share = fair_share_minutes()
    for r in sorted((E / "runs").glob("*/")):
        rows = rows_of(r / "metrics.jsonl")
        train = [x for x in rows if "tau" in x]
        held = [{"step": x["step"], "eval_tau": x["eval_tau"], "eval_acc": x.get("eval_acc")} for x in rows if "eval_tau" in x]
        rec = {"heldout": held}
        if train:
            w = train[-50:]
            rec.update(step=train[-1]["step"], loss=train[-1]["loss"], tau_last50=sum(x["tau"] for x in w) / len(w),
                       shared_step_s=step_s(train), peak_mem_gb=train[-1].get("peak_mem_gb"),
                       data_wait=sum(x.get("data_wait_frac", 0) for x in w) / len(w))
        if r.name == "long" and train:
            solo = [x for x in train if x["step"] <= max(1, _solo_steps())]
            rec["solo_step_s"] = step_s(solo, skip=20)
            rec["solo_steps"] = len(solo)
        if r.name in share:
            rec["fair_share"] = share[r.name]["at"][::6] + share[r.name]["at"][-1:]
        out["runs"][r.name] = rec
    for e in sorted((E / "eval").glob("*@*.json")):
        ev = json.loads(e.read_text())
        on = ev.get("online", {})
        out["evals"][e.stem] = {k: on.get(k) for k in ("tau", "num_prompts", "speedup", "reference", "tokens_per_s")}
        out["evals"][e.stem]["lossless"] = ev.get("lossless")
        if on.get("confidence"):
            out["evals"][e.stem]["confidence"] = {k: on["confidence"].get(k) for k in ("tau", "threshold", "verified")}
    out["stores"] = {}
    for s in sorted((E / "stores").glob("*/")):
        out["stores"][s.name] = [json.loads(p.read_text()) for p in s.glob("shard-*/status.json")]
    gen = E / "logs" / "generate.log"
    out["generate_tail"] = gen.read_text(errors="replace")[-1500:] if gen.is_file() else None
    return out


def _solo_steps() -> int:
    """long's last step before the screen started (study.log's 'long alone ... step N')."""
    for line in (E / "study.log").read_text().split("\n") if (E / "study.log").is_file() else []:
        if "long alone for" in line:
            return int(line.rsplit("step ", 1)[1])
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "run":
        try:
            drive()
        except Exception:
            import traceback

            log("driver: crashed\n" + traceback.format_exc())
    else:
        print(json.dumps(collect(), indent=1, default=str))
