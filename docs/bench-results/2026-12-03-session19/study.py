"""Session 19's study driver on the real target (SmolLM2-135M-Instruct, ShareGPT), on one H200.

In /root/ex (examples/smollm2 laid out by c3.sh), one process runs the example's own commands and logs each
with its time (study.log); every training run and eval runs in its own process session.
  1. the target stage;
  2. issue 32, item 3: bench/capture_rate.py --cli on 2,000 ShareGPT training conversations, alone on the
     GPU (the bare forward, the capture, and `dflash precompute` in the example's default layout);
  3. `dflash generate` in one process (batch GEN_BATCH) over the first exchanges of the 193 held-out and up
     to 16,630 training conversations, for at most GEN_DEADLINE_S seconds (then stopped, and what its
     journal holds is used); beside it, the online eval's target-only reference (a 1-step run on a small
     store of the held-out conversations, evaluated with --reference);
  4. the stores of the regenerated replies, with the final hidden state: gen (training) and heldout_gen
     (the held-out replies: every run's offline held-out tau, every 100 steps);
  5. the screen: RUNS at once, each STEPS steps, 8 packed rows a step, one change from `g` (the CLI's
     defaults); GPU-minutes are the fair share (wall time over the training runs alive);
  6. online evals (100 held-out prompts x 128 new tokens, lossless-checked, 4 worker processes, the shared
     reference) of each run's last checkpoint: at most EVALS_BUSY at once while runs train, EVALS after.
`python3 study.py collect` prints the summary (study.json).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

E = Path(os.environ.get("STUDY_DIR", "/root/ex"))
CODE = Path(os.environ.get("CODE", "/root/code"))
DF = [sys.executable, "-m", "dflash.cli"]
STEPS = int(os.environ.get("STEPS", 400))
WORKERS = os.environ.get("WORKERS", "2")
EVALS = int(os.environ.get("EVALS", 4))
EVALS_BUSY = int(os.environ.get("EVALS_BUSY", 1))
GPUS = os.environ.get("GPUS", "0")
GEN_BATCH = os.environ.get("GEN_BATCH", "384")
GEN_NEW = os.environ.get("GEN_NEW", "256")
GEN_DEADLINE_S = float(os.environ.get("GEN_DEADLINE_S", 300))
EVAL_ARGS = os.environ.get("EVAL_ARGS", "--max-samples 100 --max-new-tokens 128 --workers 4").split()
GEN_GPUS = os.environ.get("GEN_GPUS", "0")
PRE_ARGS = os.environ.get("PRE_ARGS", "").split()  # --gpus cpu for a CPU dry run
MIN_TRAIN, MIN_HELD = int(os.environ.get("MIN_TRAIN", 500)), int(os.environ.get("MIN_HELD", 50))
COMMON = ["--gpus", GPUS, "--num-workers", WORKERS, "--overwrite", "--rows-per-batch", "8"]
EVERY = ["--save-every", "200", "--eval-every", "100", "--eval-store", "stores/heldout_gen"]
RUNS = {
    "g": [],
    "a256": ["--num-anchors", "256", "--block-budget", "16384"],
    "init": ["--drafter-init", "target"],
    "d2p": ["--arch", "dflash2", "--loss", "dpace"],
    "dspark": ["--arch", "dspark"],
    "dspark_topk": ["--arch", "dspark", "--tv-source", "topk"],
}
if os.environ.get("RUNS"):
    RUNS = {k: v for k, v in RUNS.items() if k in os.environ["RUNS"].split(",")}


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
    return DF + ["eval", "--run", str(ck), "--prompts", "data/heldout.jsonl", "--reference", "eval/reference.json",
                 "--no-plots", "--out", f"eval/{name}@{ck.name}.json"] + EVAL_ARGS


def rows_of(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").split("\n") if x.strip()] if path.is_file() else []


def generated_rows() -> list[dict]:
    """generate's output, or, when it was stopped at its deadline, the rows its journal holds (row order)."""
    out = E / "data/gen_all.jsonl"
    if out.is_file():
        return rows_of(out)
    from dflash.generate.journal import load_records, work_dir

    recs = load_records(work_dir(out))
    return [recs[r]["out"] for r in sorted(recs) if recs[r].get("out")]


def split_generated() -> tuple[int, int]:
    """The held-out ids go to heldout_gen.jsonl, the rest to generated.jsonl; all of them to gen_all.jsonl."""
    held = {r["id"] for r in rows_of(E / "data/heldout.jsonl")}
    rows = generated_rows()
    n = [0, 0]
    with open(E / "data/generated.jsonl", "w", encoding="utf-8") as g, \
            open(E / "data/heldout_gen.jsonl", "w", encoding="utf-8") as h:
        for r in rows:
            is_held = r["id"] in held
            (h if is_held else g).write(json.dumps(r, ensure_ascii=False) + "\n")
            n[is_held] += 1
    if not (E / "data/gen_all.jsonl").is_file():
        with open(E / "data/gen_all.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    return n[0], n[1]


def last_step(name: str) -> int:
    for r in reversed(rows_of(E / "runs" / name / "metrics.jsonl")):
        if "tau" in r:
            return int(r["step"])
    return 0


def stop(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(30)
    except Exception:
        os.killpg(p.pid, signal.SIGKILL)


def drive() -> None:
    (E / "logs").mkdir(exist_ok=True)
    (E / "eval").mkdir(exist_ok=True)
    log(f"driver: runs {','.join(RUNS)} x {STEPS} steps, {WORKERS} loader workers; generate batch {GEN_BATCH}")
    if not (E / "model/config.json").exists() and run("target", [sys.executable, "stages/target.py"], 300):
        return log("driver: the target stage failed; stopping")
    if not os.environ.get("SKIP_CAPTURE"):
        run("capture_rate", [sys.executable, str(CODE / "bench/capture_rate.py"), "--target", "model", "--data",
                             "data/train2k.jsonl", "--rows", "2000", "--token-budget", "65536", "--cli",
                             "--cli-dir", "/root/tmp", "--out", str(E / "capture_rate.json")], 400)
    def generate(batch: str) -> subprocess.Popen:
        return bg("generate", DF + ["generate", "--data", "data/gen_prompts_all.jsonl", "--out", "data/gen_all.jsonl",
                                    "--gpus", GEN_GPUS, "--batch-size", batch, "--max-new-tokens", GEN_NEW])

    gen = generate(GEN_BATCH)
    t_gen = time.time()
    ref = None
    if run("precompute_heldout_sg", DF + ["precompute", "--data", "data/heldout.jsonl", "--out", "stores/heldout_sg"] + PRE_ARGS, 300) == 0 \
            and run("train_ref", train_cmd("ref", "heldout_sg", 1, [], ["--eval-every", "0"]), 300) == 0 and checkpoints("ref"):
        ref = bg("eval_ref", eval_cmd("ref", checkpoints("ref")[-1]))
    retried = False
    while time.time() - t_gen < GEN_DEADLINE_S:
        if gen.poll() is not None:
            if gen.returncode == 0 or retried:
                break
            # out of memory at this batch size, say: resume its journal at a smaller one
            log(f"generate: exit {gen.returncode} at batch {GEN_BATCH}; again at 128")
            os.replace(E / "logs/generate.log", E / "logs/generate_first.log")
            gen, retried = generate("128"), True
        time.sleep(2)
    if gen.poll() is None:
        stop(gen)
        log(f"generate: stopped at its deadline ({GEN_DEADLINE_S:.0f} s)")
    else:
        log(f"generate: exit {gen.returncode} in {time.time() - t_gen:.1f} s")
    n_train, n_held = split_generated()
    log(f"generated: {n_train} training, {n_held} held-out samples")
    if n_train < MIN_TRAIN or n_held < MIN_HELD:
        return log("driver: too few generated samples; stopping")
    for name, data in (("heldout_gen", "data/heldout_gen.jsonl"), ("gen", "data/generated.jsonl")):
        if run(f"precompute_{name}", DF + ["precompute", "--data", data, "--out", f"stores/{name}", "--final-hidden"] + PRE_ARGS, 400):
            return log(f"driver: precompute {name} failed; stopping")
    procs = {name: bg(f"train_{name}", train_cmd(name, "gen", STEPS, flags)) for name, flags in RUNS.items()}
    watch(procs, ref)


def watch(procs: dict, ref) -> None:
    queue, queued, evals, ended = [], set(), {}, set()
    if ref is not None:
        evals[("ref", "reference")] = ref
    while True:
        for name, p in procs.items():
            if p.poll() is not None and name not in ended:
                ended.add(name)
                log(f"train_{name}: exit {p.returncode} at step {last_step(name)}")
                cks = checkpoints(name)
                if cks and (name, cks[-1].name) not in queued:
                    queued.add((name, cks[-1].name))
                    queue.append((name, cks[-1]))
        for key in [k for k, p in evals.items() if p.poll() is not None]:
            log(f"eval {key[0]}@{key[1]}: exit {evals.pop(key).returncode}")
        alive = [n for n, p in procs.items() if p.poll() is None]
        cap = EVALS_BUSY if alive else EVALS
        while queue and len(evals) < cap and (E / "eval/reference.json").exists():
            name, c = queue.pop(0)
            evals[(name, c.name)] = bg(f"eval_{name}@{c.name}", eval_cmd(name, c))
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip() if GPUS.isdigit() else ""
        with open(E / "progress.log", "a") as f:  # time, runs alive, evals alive, GPU, each run's step
            f.write(json.dumps({"t": round(time.time(), 1), "alive": alive, "evals": len(evals), "gpu": gpu,
                                "steps": {n: last_step(n) for n in procs}}) + "\n")
        if not alive and not queue and not evals:
            break
        if os.environ.get("STOP_AT") and time.time() > float(os.environ["STOP_AT"]):
            break
        time.sleep(5)
    log("driver: done")


def step_s(rows: list[dict], skip: int = 20) -> float | None:
    """Seconds per step on the device's timeline, from the trainer's own per-step token rates."""
    xs = [r["ctx_tokens"] / r["ctx_tokens_per_s"] for r in rows[skip:] if r.get("ctx_tokens_per_s")]
    return sum(xs) / len(xs) if xs else None


def fair_share_minutes() -> dict:
    """Each run's GPU-minutes at each step it passed: the wall time it ran over the number of training runs
    alive (evals not counted), integrated from progress.log."""
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
        rec = {"heldout": [{"step": x["step"], "eval_tau": x["eval_tau"]} for x in rows if "eval_tau" in x]}
        if train:
            w = train[-50:]
            rec.update(step=train[-1]["step"], loss=train[-1]["loss"], tau_last50=sum(x["tau"] for x in w) / len(w),
                       shared_step_s=step_s(train), peak_mem_gb=train[-1].get("peak_mem_gb"),
                       samples_per_step=sum(x.get("samples", 0) for x in w) / len(w),
                       data_wait=sum(x.get("data_wait_frac", 0) for x in w) / len(w))
        if r.name in share:
            rec["fair_share"] = share[r.name]["at"][::6] + share[r.name]["at"][-1:]
            rec["fair_share_minutes"] = round(share[r.name]["minutes"], 3)
        out["runs"][r.name] = rec
    for e in sorted((E / "eval").glob("*@*.json")):
        ev = json.loads(e.read_text())
        on = ev.get("online", {})
        out["evals"][e.stem] = {k: on.get(k) for k in ("tau", "num_prompts", "speedup", "tokens_per_s_target",
                                                         "tokens_per_s_speculative", "dtype")}
        out["evals"][e.stem]["lossless"] = ev.get("lossless", on.get("lossless"))
        if on.get("confidence"):
            out["evals"][e.stem]["confidence"] = {k: on["confidence"].get(k) for k in ("tau", "threshold", "verified")}
    out["stores"] = {s.name: [json.loads(p.read_text()) for p in s.glob("shard-*/status.json")]
                     for s in sorted((E / "stores").glob("*/"))}
    cap = E / "capture_rate.json"
    out["capture_rate"] = json.loads(cap.read_text()) if cap.is_file() else None
    gen = E / "logs" / "generate.log"
    out["generate_tail"] = gen.read_text(errors="replace")[-1500:] if gen.is_file() else None
    return out


if __name__ == "__main__":
    if sys.argv[1] == "run":
        try:
            drive()
        except Exception:
            import traceback

            log("driver: crashed\n" + traceback.format_exc())
    else:
        print(json.dumps(collect(), indent=1, default=str))
