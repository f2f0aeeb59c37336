"""Session 17's study driver on the real target (SmolLM2-135M-Instruct, ShareGPT), on one H200; a copy of
session 16's with this session's order and runs.  In /root/ex (examples/smollm2 laid out by c3.sh):
  1. the target stage;
  2. `dflash precompute --final-hidden` of the 4K training conversations, alone (the CLI's capture rate
     after this session's start-up overlap and commit interval); [CAPTURE_EXP] the first 2,000 again with
     the old commit interval (32,768 tokens);
  3. `dflash generate` of GEN_PROMPTS first exchanges (alone but for the held-out precompute and the
     target-only reference eval, REF_FIRST), then its store with the final hidden state;
  4. the screen: every run in its own process session, all sharing the GPU, held-out tau every 100 steps;
     runs on the ShareGPT store (r8, r8_tl) and on the regenerated store (g8*), and `long`;
  5. online evals (100 held-out prompts x 128 new tokens, lossless-checked, EVAL_WORKERS processes each)
     of every run's last checkpoint and of long's LONG_EVAL_STEPS, reusing the reference;
  6. [SOLO] each drafter shape alone for SOLO_STEPS steps (the step time behind GPU-minutes).
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
SCREEN_STEPS = int(os.environ.get("SCREEN_STEPS", 600))
LONG_STEPS = int(os.environ.get("LONG_STEPS", 2400))
EVALS = int(os.environ.get("EVALS", 8))
SOLO_STEPS = int(os.environ.get("SOLO_STEPS", 60))
GPUS = os.environ.get("GPUS", "0")  # cpu:1 and cpu for a CPU dry run of the driver
GEN_GPUS = os.environ.get("GEN_GPUS", ",".join(["0"] * 8))
COMMON = ["--gpus", GPUS, "--save-every", "100", "--eval-every", "100", "--eval-store", "stores/heldout",
          "--num-workers", "1", "--overwrite"]
R8 = ["--rows-per-batch", os.environ.get("ROWS", "8")]
# name: (store, steps, flags).  r8 is the screen's baseline: the CLI defaults but 8 packed rows per step
# (one row leaves the H200 idle at this size); every other run changes one thing from it.
RUNS = {
    "r8": ("train", SCREEN_STEPS, R8),
    "r8_tl": ("train", SCREEN_STEPS, R8 + ["--labels", "target"]),
}
GEN_RUNS = {
    "g8": ("generated", SCREEN_STEPS, R8),
    "g8_d2": ("generated", SCREEN_STEPS, R8 + ["--arch", "dflash2"]),
    "g8_dspark": ("generated", SCREEN_STEPS, R8 + ["--arch", "dspark"]),
    "g8_dspark_topk": ("generated", SCREEN_STEPS, R8 + ["--arch", "dspark", "--tv-source", "topk"]),
    "long": ("generated", LONG_STEPS, R8 + ["--arch", "dflash2", "--keep-checkpoints", "40"]),
}
GEN_PROMPTS = int(os.environ.get("GEN_PROMPTS", 4000))  # first exchanges regenerated; 0 = no generate
LONG_EVAL_STEPS = tuple(int(x) for x in os.environ.get("LONG_EVAL_STEPS", "600,1200,2400").split(","))
SOLO = {"r8": ("train", R8), "g8_d2": ("generated", R8 + ["--arch", "dflash2"]),
        "g8_dspark": ("generated", R8 + ["--arch", "dspark"])}


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


def train_cmd(name: str, store: str, steps: int, flags: list[str], out: str = "runs") -> list[str]:
    return DF + ["train", "--store", f"stores/{store}", "--out", f"{out}/{name}", "--steps", str(steps)] + COMMON + flags


def checkpoints(name: str, where: str = "runs") -> list[Path]:
    return sorted((E / where / name / "checkpoints").glob("step-*"))


def solo(names) -> None:
    """Each shape alone on the GPU: the step time that turns a shared run's steps into GPU-minutes."""
    for name in names:
        if (E / "solo" / name / "checkpoints").is_dir():
            continue
        store, flags = SOLO[name]
        cmd = DF + ["train", "--store", f"stores/{store}", "--out", f"solo/{name}", "--steps", str(SOLO_STEPS),
                    "--gpus", GPUS, "--num-workers", "1", "--eval-every", "0", "--overwrite"] + flags
        run(f"solo_{name}", cmd, 240)


EVAL_WORKERS = os.environ.get("EVAL_WORKERS", "1")  # eval --workers (new after session 16's leases)


def eval_cmd(name: str, ck: Path) -> list[str]:
    return DF + ["eval", "--run", str(ck), "--workers", EVAL_WORKERS, "--prompts", "data/heldout.jsonl", "--max-samples",
                 os.environ.get("EVAL_PROMPTS", "100"), "--max-new-tokens", os.environ.get("EVAL_TOKENS", "128"), "--reference", "eval/reference.json", "--no-plots",
                 "--out", f"eval/{name}@{ck.name}.json"]


def first_exchanges(src: Path, dst: Path, limit: int, max_chars: int = 6000) -> int:
    """The first user/assistant exchange of the first `limit` training conversations whose user turn is at
    most max_chars long (a longer prompt would take a whole batch's KV cache; none is regenerated)."""
    n = 0
    with open(src, encoding="utf-8") as f, open(dst, "w", encoding="utf-8") as g:
        for line in f.read().split("\n"):
            if not line.strip():
                continue
            row = json.loads(line)
            if n < limit and len(row["messages"][0]["content"]) <= max_chars:
                g.write(json.dumps({"id": row["id"], "messages": row["messages"][:2]}, ensure_ascii=False) + "\n")
                n += 1
    return n


def capture_experiments() -> None:
    """What bounds the CLI's capture on a small target (issue 32): the disk's own write rate, then the first
    2,000 training conversations captured again with commits every 1M tokens instead of 32K, in bf16 and
    in fp8; each store's shard status is kept and the store removed (the disk holds one at a time)."""
    import shutil

    out = E / "capture_exp"
    out.mkdir(exist_ok=True)
    t = time.time()
    for name, flags in {"commit32k_bf16": ["--commit-every-tokens", "32768"]}.items():
        store = E / "stores" / f"cap_{name}"
        run(f"capture_{name}", DF + ["precompute", "--final-hidden", "--max-samples", "2000", "--out", str(store),
                                     "--overwrite"] + flags, 300)
        for st in store.glob("shard-*/status.json"):
            shutil.copy(st, out / f"{name}.json")
        shutil.rmtree(store, ignore_errors=True)


def drive(code: Path) -> None:
    (E / "logs").mkdir(exist_ok=True)
    (E / "eval").mkdir(exist_ok=True)
    log(f"driver: screen {SCREEN_STEPS} steps, runs {','.join(RUNS)}, evals {EVALS} at once")
    # each step already done (a restarted driver) is skipped; precompute resumes a complete store at once
    if not (E / "model/config.json").exists() and run("target", [sys.executable, "stages/target.py"], 300):
        return log("driver: the target stage failed; stopping")
    wait = Path(os.environ.get("WAIT_FOR", "/root/b33/bench33.out"))  # the GPU alone for the capture's rate
    for _ in range(80):
        if not wait.is_file() or "bench33 done" in wait.read_text():
            break
        time.sleep(5)
    log("driver: the GPU is free")
    if run("precompute_train", DF + ["precompute", "--final-hidden"], 400):
        return log("driver: precompute failed; stopping")
    if os.environ.get("CAPTURE_EXP"):
        capture_experiments()
    if os.environ.get("CAPTURE_ONLY"):  # session 17's lease came late: the capture and the step bench only
        return log("driver: done")
    n = first_exchanges(E / "data/train.jsonl", E / "data/prompts.jsonl", GEN_PROMPTS)
    log(f"first exchanges for generate: {n}")
    gen = bg("generate", DF + ["generate", "--gpus", GEN_GPUS, "--batch-size", os.environ.get("GEN_BATCH", "128")]) if GEN_PROMPTS else None
    run("precompute_heldout", DF + ["precompute", "--data", "data/heldout.jsonl", "--out", "stores/heldout",
                                     "--final-hidden"], 200)
    ref_started = False
    if os.environ.get("REF_FIRST"):  # the target-only reference beside generate
        run("train_ref", train_cmd("ref", "train", 1, R8), 300)
        ref_started = bool(checkpoints("ref")) and run("eval_ref", eval_cmd("ref", checkpoints("ref")[-1]), 900) == 0
    procs = {name: bg(f"train_{name}", train_cmd(name, *spec)) for name, spec in RUNS.items()}
    pending_gen, queue, queued, evals = gen is not None, [], set(), {}
    while True:
        if pending_gen and gen.poll() is not None:
            pending_gen = False
            log(f"generate: exit {gen.returncode}")
            if gen.returncode == 0 and run("precompute_generated", DF + ["precompute", "--data", "data/generated.jsonl",
                                                                       "--out", "stores/generated", "--final-hidden"], 400) == 0:
                procs.update({n: bg(f"train_{n}", train_cmd(n, *s)) for n, s in GEN_RUNS.items()})
        if not ref_started and checkpoints("r8"):  # r8's first checkpoint writes the target-only reference
            ref_started, c = True, checkpoints("r8")[0]
            queued.add(("r8", c.name))
            evals[("r8", c.name)] = bg(f"eval_r8@{c.name}", eval_cmd("r8", c))
        for name, p in procs.items():
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
        while queue and len(evals) < EVALS and (E / "eval/reference.json").exists():
            name, c = queue.pop(0)
            evals[(name, c.name)] = bg(f"eval_{name}@{c.name}", eval_cmd(name, c))
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip() if GPUS != "cpu:1" else ""
        with open(E / "gpu.log", "a") as f:
            f.write(f"{time.time():.0f} {sum(p.poll() is None for p in procs.values())} {len(evals)} {gpu}\n")
        training = any(p.poll() is None for p in procs.values())
        if not training and not pending_gen and not queue and not evals:
            break
        time.sleep(5)
    if os.environ.get("SOLO"):
        solo(list(SOLO))
    log("driver: done")


def rows_of(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().split("\n") if x.strip()] if path.is_file() else []


def step_s(rows: list[dict], skip: int = 20) -> float | None:
    """Seconds per step from the trainer's own per-step token rates (warm-up steps left out)."""
    xs = [r["ctx_tokens"] / r["ctx_tokens_per_s"] for r in rows[skip:] if r.get("ctx_tokens_per_s")]
    return sum(xs) / len(xs) if xs else None


def collect() -> dict:
    out: dict = {"runs": {}, "solo": {}, "evals": {}}
    for r in sorted((E / "runs").glob("*/")):
        rows = rows_of(r / "metrics.jsonl")
        train = [x for x in rows if "tau" in x]
        held = [{"step": x["step"], "eval_tau": x["eval_tau"]} for x in rows if "eval_tau" in x]
        rec = {"heldout": held}
        if train:
            last = train[-1]
            w = train[-50:]
            rec.update(step=last["step"], loss=last["loss"], tau_last50=sum(x["tau"] for x in w) / len(w),
                       shared_step_s=step_s(train))
        out["runs"][r.name] = rec
    for r in sorted((E / "solo").glob("*/")):
        out["solo"][r.name] = {"step_s": step_s([x for x in rows_of(r / "metrics.jsonl") if "tau" in x])}
    for e in sorted((E / "eval").glob("*@*.json")):
        ev = json.loads(e.read_text())
        on = ev.get("online", {})
        out["evals"][e.stem] = {k: on.get(k) for k in ("tau", "num_prompts", "speedup", "reference")}
        out["evals"][e.stem]["lossless"] = ev.get("lossless")
        if on.get("confidence"):
            out["evals"][e.stem]["confidence"] = {k: on["confidence"].get(k) for k in ("tau", "threshold", "verified")}
    for name in ("capture_rate.json",):
        if (E / name).is_file():
            out[name] = json.loads((E / name).read_text())
    out["capture_exp"] = {p.stem: json.loads(p.read_text()) for p in sorted((E / "capture_exp").glob("*.json"))}
    out["stores"] = {}
    for s in sorted((E / "stores").glob("*/")):
        st = [json.loads(p.read_text()) for p in s.glob("shard-*/status.json")]
        out["stores"][s.name] = st
    return out


if __name__ == "__main__":
    if sys.argv[1] == "run":
        try:
            drive(Path(sys.argv[2]))
        except Exception:
            import traceback

            log("driver: crashed\n" + traceback.format_exc())
    else:
        print(json.dumps(collect(), indent=1, default=str))
