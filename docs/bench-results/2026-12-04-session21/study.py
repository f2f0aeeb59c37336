"""Session 21's study driver on the real target (SmolLM2-135M-Instruct, ShareGPT), on one H200: the
example's defaults (DT) in one long run, and session 20's DSpark run (S) again, beside it, for its online tau.

In /root/ex (examples/smollm2 laid out by c4.sh, with all 17,129 training conversations and session 19's
1,536 regenerated replies), one process runs the project's own commands and logs each with its time
(study.log); every training run and eval runs in its own process session.
  1. the target stage;
  2. the stores at once: heldout_sg (the online reference's run), heldout_gen (the target's own replies to
     the held-out first exchanges, session 19; with the final hidden state), both bf16 as in session 20,
     and `all` (every training conversation, fp8, top-8); as soon as heldout_sg is written, a one-step run
     on it and the eval that writes the target-only reference (it outlasts the precompute);
  3. RUNS at once on `all`: STEPS_<RUN> steps each (a cosine over them), stopped at TRAIN_S x OVERRUN;
     held-out tau on heldout_gen every EVERY steps; GPU-minutes from progress.log (fair share: wall time
     over the training runs alive; and wall time);
  4. online evals (100 held-out prompts x 128 new tokens, lossless-checked, one shared target-only
     reference): the checkpoints at the fractions MID_AT of each MID run while it trains, and every run's
     last checkpoint; EVALS_BUSY at once while runs train, EVALS after; EVAL_WORKERS_<RUN> processes each.
`python3 study.py collect` prints the summary (study.json).

Env: RUNS, TRAIN_S, OVERRUN, STEPS_<RUN>, WORKERS_<RUN>, MID, MID_AT, EVERY, EVERY_<RUN>, EVALS, EVALS_BUSY, EVAL_ARGS,
EVAL_WORKERS_<RUN>.
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
TRAIN_S = float(os.environ.get("TRAIN_S", 540))
WORKERS = os.environ.get("WORKERS", "3")  # loader workers of a run without WORKERS_<RUN>
EVALS = int(os.environ.get("EVALS", 3))
EVALS_BUSY = int(os.environ.get("EVALS_BUSY", 1))
GPUS = os.environ.get("GPUS", "0")
EVAL_ARGS = os.environ.get("EVAL_ARGS", "--max-samples 100 --max-new-tokens 128").split()
PRE_ARGS = os.environ.get("PRE_ARGS", "").split()  # --gpus cpu for a CPU dry run
ALL_ARGS = os.environ.get("ALL_ARGS", "--hidden-dtype fp8").split()
COMMON = ["--gpus", GPUS, "--overwrite", "--rows-per-batch", "8", "--keep-checkpoints", "20"]
EVERY_N = os.environ.get("EVERY", "250")  # checkpoint and held-out tau every N steps (EVERY_<RUN> for one run)
# name: (expected seconds per step with five runs sharing, flags); every flag the run depends on is explicit,
# so the example's params.yaml (changed after session 20) decides nothing but the shared shape
RUNS = {
    "L": (0.36, ["--arch", "dflash", "--loss", "ce", "--labels", "data"]),
    "T": (0.36, ["--arch", "dflash", "--loss", "ce", "--labels", "target"]),
    "D": (0.55, ["--arch", "dflash2", "--loss", "dpace", "--labels", "data"]),
    "DT": (0.55, ["--arch", "dflash2", "--loss", "dpace", "--labels", "target"]),
    "S": (0.62, ["--arch", "dspark", "--tv-source", "topk", "--loss", "ce", "--labels", "data"]),
}
if os.environ.get("RUNS"):
    RUNS = {k: v for k, v in RUNS.items() if k in os.environ["RUNS"].split(",")}
MID = os.environ.get("MID", "DT").split(",")  # runs whose checkpoints at MID_AT are evaluated online too
MID_AT = [float(x) for x in os.environ.get("MID_AT", "0.25,0.5,0.75").split(",") if x]


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


def steps_of(sec_per_step: float) -> int:
    return max(int(os.environ.get("MIN_STEPS", 250)), int(TRAIN_S / sec_per_step) // 50 * 50)


def every_of(name: str) -> list[str]:
    n = os.environ.get(f"EVERY_{name}", EVERY_N)
    return ["--save-every", n, "--eval-every", n, "--eval-store", "stores/heldout_gen"]


def train_cmd(name: str, store: str, steps: int, flags: list[str], every: list[str] | None = None) -> list[str]:
    every = every_of(name) if every is None else every
    workers = ["--num-workers", os.environ.get(f"WORKERS_{name}", WORKERS)]
    return DF + ["train", "--store", f"stores/{store}", "--out", f"runs/{name}", "--steps", str(steps)] + COMMON + workers + every + flags


def checkpoints(name: str) -> list[Path]:
    return sorted((E / "runs" / name / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))


def eval_cmd(name: str, ck: Path) -> list[str]:
    return DF + ["eval", "--run", str(ck), "--prompts", "data/heldout.jsonl", "--reference", "eval/reference.json",
                 "--no-plots", "--out", f"eval/{name}@{ck.name}.json",
                 "--workers", os.environ.get(f"EVAL_WORKERS_{name}", "5")] + EVAL_ARGS


def rows_of(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").split("\n") if x.strip()] if path.is_file() else []


def split_generated() -> tuple[int, int]:
    """Session 19's replies: the held-out ids to heldout_gen.jsonl, the rest to generated.jsonl."""
    held = {r["id"] for r in rows_of(E / "data/heldout.jsonl")}
    n = [0, 0]
    with open(E / "data/generated.jsonl", "w", encoding="utf-8") as g, \
            open(E / "data/heldout_gen.jsonl", "w", encoding="utf-8") as h:
        for r in rows_of(E / "data/gen_all.jsonl"):
            is_held = r["id"] in held
            (h if is_held else g).write(json.dumps(r, ensure_ascii=False) + "\n")
            n[is_held] += 1
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
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except Exception:
            pass


def drive() -> None:
    (E / "logs").mkdir(exist_ok=True)
    (E / "eval").mkdir(exist_ok=True)
    # STEPS_<RUN>=N sets a run's steps outright (a run alone, whose rate the five-run estimates do not give)
    plan = {n: int(os.environ.get(f"STEPS_{n}", 0)) or steps_of(s) for n, (s, _) in RUNS.items()}
    log(f"driver: runs {plan} in ~{TRAIN_S:.0f} s, {WORKERS} loader workers each")
    if not (E / "model/config.json").exists() and run("target", [sys.executable, "stages/target.py"], 300):
        return log("driver: the target stage failed; stopping")
    if not os.environ.get("SKIP_FORWARD"):
        run("forward_rate", [sys.executable, str(CODE / "bench/capture_rate.py"), "--target", "model", "--data",
                             "data/train.jsonl", "--rows", "1000", "--token-budget", "65536",
                             "--out", str(E / "forward_rate.json")], 300)
    n_train, n_held = split_generated()
    log(f"regenerated: {n_train} training, {n_held} held-out samples")
    small = {"heldout_sg": ("data/heldout.jsonl", []), "heldout_gen": ("data/heldout_gen.jsonl", ["--final-hidden"])}
    pre = {k: bg(f"precompute_{k}", DF + ["precompute", "--data", d, "--out", f"stores/{k}", "--hidden-dtype", "bf16"] + f)
           for k, (d, f) in small.items()}
    pre["all"] = bg("precompute_all", DF + ["precompute", "--data", "data/train.jsonl", "--out", "stores/all"] + ALL_ARGS)
    ref = None
    if pre["heldout_sg"].wait() == 0:
        log("precompute_heldout_sg: exit 0")
        if run("train_ref", train_cmd("ref", "heldout_sg", 1, ["--arch", "dflash"], ["--eval-every", "0"]),
               400) == 0 and checkpoints("ref"):
            ref = bg("eval_ref", eval_cmd("ref", checkpoints("ref")[-1]))
    for k, p in pre.items():
        log(f"precompute_{k}: exit {p.wait()}")
    if pre["all"].returncode or pre["heldout_gen"].returncode:
        return log("driver: a store failed; stopping")
    t_train = time.time()
    procs = {name: bg(f"train_{name}", train_cmd(name, "all", plan[name], flags)) for name, (_, flags) in RUNS.items()}
    watch(procs, ref, plan, t_train)


def watch(procs: dict, ref, plan: dict, t_train: float) -> None:
    queue, queued, evals, ended = [], set(), {}, set()
    if ref is not None:
        evals[("ref", "reference")] = ref
    deadline = t_train + TRAIN_S * float(os.environ.get("OVERRUN", 1.25))
    while True:
        for name, p in procs.items():
            for frac in MID_AT if name in MID and p.poll() is None else []:
                # the first checkpoint at or past this fraction of the run, once written
                past = [c for c in checkpoints(name) if int(c.name.split("-")[1]) >= frac * plan[name]]
                if past and (name, past[0].name) not in queued:
                    queued.add((name, past[0].name))
                    queue.append((name, past[0]))
            if p.poll() is None and time.time() > deadline:
                log(f"train_{name}: stopped at the window's end (step {last_step(name)})")
                stop(p)
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
        # finals first once training is over
        if not alive:  # last checkpoints first, and among them the runs named in EVAL_FIRST
            finals = {f"{n}@{checkpoints(n)[-1].name}" for n in procs if checkpoints(n)}
            first = os.environ.get("EVAL_FIRST", "").split(",")
            queue.sort(key=lambda x: (f"{x[0]}@{x[1].name}" not in finals, x[0] not in first))
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
                acc = out.setdefault(n, {"minutes": 0.0, "wall_minutes": 0.0, "at": []})
                acc["minutes"] += dt
                acc["wall_minutes"] += (r["t"] - prev["t"]) / 60
                acc["at"].append((r["steps"].get(n, 0), round(acc["minutes"], 3)))
        prev = r
    return out


def collect() -> dict:
    out: dict = {"runs": {}, "evals": {}}
    share = fair_share_minutes()
    for r in sorted((E / "runs").glob("*/")):
        rows = rows_of(r / "metrics.jsonl")
        train = [x for x in rows if "tau" in x]
        rec = {"heldout": [{"step": x["step"], "eval_tau": x["eval_tau"], "eval_acc_first": (x.get("eval_acc") or [None])[0]}
                           for x in rows if "eval_tau" in x]}
        if train:
            w = train[-50:]
            rec.update(step=train[-1]["step"], loss=train[-1]["loss"], tau_last50=sum(x["tau"] for x in w) / len(w),
                       shared_step_s=step_s(train), peak_mem_gb=train[-1].get("peak_mem_gb"),
                       samples_per_step=sum(x.get("samples", 0) for x in w) / len(w),
                       data_wait=sum(x.get("data_wait_frac", 0) for x in w) / len(w))
        if r.name in share:
            rec["fair_share"] = share[r.name]["at"][::6] + share[r.name]["at"][-1:]
            rec["fair_share_minutes"] = round(share[r.name]["minutes"], 3)
            rec["wall_minutes"] = round(share[r.name]["wall_minutes"], 3)
        out["runs"][r.name] = rec
    for e in sorted((E / "eval").glob("*@*.json")):
        ev = json.loads(e.read_text())
        on = ev.get("online", {})
        out["evals"][e.stem] = {k: on.get(k) for k in ("tau", "num_prompts", "prompts_left_out", "speedup",
                                                         "tokens_per_s_target", "tokens_per_s_speculative", "dtype")}
        out["evals"][e.stem]["lossless"] = ev.get("lossless", on.get("lossless"))
        if on.get("confidence"):
            out["evals"][e.stem]["confidence"] = {k: on["confidence"].get(k) for k in ("tau", "threshold", "verified")}
    out["stores"] = {s.name: [json.loads(p.read_text()) for p in s.glob("shard-*/status.json")]
                     for s in sorted((E / "stores").glob("*/"))}
    fw = E / "forward_rate.json"
    out["forward_rate"] = json.loads(fw.read_text()) if fw.is_file() else None
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
