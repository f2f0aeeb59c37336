"""Session 24's driver: the example's defaults alone on the H200 with the engine's walk measured along the run.

  1. the target stage and the stores (session 22's long.py: `all` in fp8, heldout_gen in bf16) and, beside
     them, `online_gen`: the target's own fp32 greedy replies (160 tokens at most) to the first ONLINE_ROWS
     prompts of data/heldout.jsonl the online eval decodes (each conversation's turns before its last reply,
     too long ones left out as it does), one prompt at a time by the GEN_GPUS processes, precomputed in
     bf16 without truncation;
  2. the example's defaults (`DT`) alone for STEPS steps, checkpoints and held-out tau every EVERY steps,
     with `--eval-walk-tokens 128` (the walk over heldout_gen's replies: metrics eval_walk_tau);
  3. the lossless online eval of the last checkpoint (writes the reference), then `dflash eval --store
     stores/online_gen --walk` of every kept checkpoint (the walk over the online prompts' own replies),
     the last one first, then those at multiples of WALK_EVERY.

Env: STEPS, EVERY, WORKERS_DT, DEADLINE, ONLINE_ROWS, GEN_GPUS, EVAL_WORKERS_FINAL, WALK_EVERY (the
checkpoints walked: the last, and every WALK_EVERY steps).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-12-04-session22"))
import long as lg  # noqa: E402  (it imports session 21's study.py as lg.s)

s = lg.s
ONLINE_ROWS = int(os.environ.get("ONLINE_ROWS", 100))  # the online eval's --max-samples
GEN_GPUS = os.environ.get("GEN_GPUS", ",".join(["0"] * 8))  # 8 generate processes on GPU 0
s.COMMON[s.COMMON.index("--keep-checkpoints") + 1] = "60"


def online_gen():
    """Background: the target's replies to the online prompts (generate, then precompute online_gen)."""
    from dflash.evaluate.run import load_prompts, prompt_budget
    from dflash.target_model.capture import load_tokenizer

    used: list[int] = []  # exactly the rows the online eval decodes (it leaves out prompts too long)
    load_prompts(s.E / "data/heldout.jsonl", load_tokenizer(str(s.E / "model")), ONLINE_ROWS,
                 prompt_budget(str(s.E / "model"), 128), [], used)
    rows = s.rows_of(s.E / "data/heldout.jsonl")
    (s.E / "data/online_prompts.jsonl").write_text("".join(json.dumps(rows[i], ensure_ascii=False) + "\n" for i in used))
    s.log(f"online prompts: rows {used[:3]} ... {used[-3:]} ({len(used)})")
    return s.bg("generate_online", s.DF + ["generate", "--data", "data/online_prompts.jsonl", "--out",
                                           "data/online_gen.jsonl", "--turns", "last", "--max-new-tokens", "160",
                                           "--dtype", "fp32", "--batch-size", os.environ.get("GEN_BATCH", "1"), "--gpus", GEN_GPUS,
                                           "--overwrite"])


def train() -> None:
    every = ["--save-every", lg.EVERY, "--eval-every", lg.EVERY, "--eval-store", "stores/heldout_gen",
             "--eval-walk-tokens", "128"]
    p = s.bg("train_DT", s.train_cmd("DT", "all", lg.STEPS, s.RUNS["DT"][1], every))
    while p.poll() is None:
        with open(s.E / "progress.log", "a") as f:
            f.write(json.dumps({"t": round(time.time(), 1), "alive": ["DT"], "evals": 0, "gpu": "",
                                "steps": {"DT": s.last_step("DT")}}) + "\n")
        if time.time() > lg.DEADLINE:
            s.log(f"train_DT: stopped at the deadline (step {s.last_step('DT')})")
            s.stop(p)
            break
        time.sleep(5)
    s.log(f"train_DT: exit {p.wait()} at step {s.last_step('DT')}")


def walks(ready: bool) -> None:
    cks = s.checkpoints("DT")
    if not ready or not cks:
        return s.log("driver: no online_gen store or no checkpoint; no walks")
    every = int(os.environ.get("WALK_EVERY", 3000))
    # --prompts "": the example's params.yaml names prompts, and an online eval per walk would cost ~160 s
    for c in [cks[-1]] + [c for c in cks[:-1] if int(c.name.split("-")[1]) % every == 0]:
        s.run(f"walk_DT@{c.name}", s.DF + ["eval", "--run", str(c), "--store", "stores/online_gen", "--walk",
                                            "--prompts", "", "--max-new-tokens", "128", "--no-plots", "--out",
                                            f"eval/walk_DT@{c.name}.json"], 120)


def main() -> None:
    (s.E / "logs").mkdir(exist_ok=True)
    (s.E / "eval").mkdir(exist_ok=True)
    s.log(f"driver (session 24): DT alone, {lg.STEPS} steps, every {lg.EVERY}, walk along; deadline "
          f"{time.strftime('%H:%M:%S', time.gmtime(lg.DEADLINE))}")
    if not (s.E / "model/config.json").exists() and s.run("target", [sys.executable, "stages/target.py"], 300):
        return s.log("driver: the target stage failed; stopping")
    gen = online_gen()
    if not lg.stores():
        return s.log("driver: a store failed; stopping")
    ready = gen.wait() == 0 and s.run("precompute_online_gen", s.DF + [
        "precompute", "--data", "data/online_gen.jsonl", "--out", "stores/online_gen", "--hidden-dtype", "bf16",
        "--max-length", "8192"], 300) == 0  # whole histories: a cut one would lose the reply walked
    s.log(f"generate_online + precompute: {'ok' if ready else 'failed'}")
    train()
    cks = s.checkpoints("DT")
    if cks:
        os.environ["EVAL_WORKERS_DT"] = os.environ.get("EVAL_WORKERS_FINAL", "14")
        s.run(f"eval_DT@{cks[-1].name}", s.eval_cmd("DT", cks[-1]))
    walks(ready)
    s.log("driver: done")


if __name__ == "__main__":
    lg.guarded(main)
