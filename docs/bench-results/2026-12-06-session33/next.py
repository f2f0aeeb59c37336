"""Session 33's plan for the next lease: 4K.gen from the replies this lease sampled, then `generate`'s rate.

Session 33's lease sampled 2 replies of the target to the first exchange of each of the first 4,000
training conversations (`results/gen_4k.jsonl.xz`, 7,984 rows) but had no time left to train on them.
Its `4K` baseline reproduced session 30's walk to the third decimal, so it is not run again: `4K` read
1.690 / 1.881 / 1.968 / 2.005 at 1,000-4,000 steps of a 4,000-step cosine.  Runs (session 29's driver,
its `BASE` = the example's defaults with one padded shape), sharing the GPU:

  4K.gen     BASE on `stores/4kgen`: the 4,000 conversations and both sampled replies to each
  4K.gen1    BASE on `stores/4kgen1`: the 4,000 conversations and the first sampled reply only
  4K.gen.s1  4K.gen with `--seed 1`
  4K.len     BASE on `stores/4klen`: the 4,000 conversations cut at 4,096 tokens instead of the example's
             2,048 (5.80M tokens against 5.40M, 29 conversations still cut against 1,096; on all 17K 24.9M
             against 23.2M): the one more text that costs no generating

Then, once they end (and only if BENCH_S seconds are left before the deadline), `bench/generate_rate.py`
on the real target, alone on the GPU, through `dflash generate`'s own loop: 512 first user turns of
training conversations of at most 200 tokens (widths 64, 128, 256), sampled at 0.8, 64 rows a batch
unless a mode says otherwise. Modes, most telling first (each pass's record is written as it ends):
`on` (since session 33: rows shortest prompt first, one static cache a width, reset between batches),
`off:256` and `off` (the dynamic cache), `hf@file` (transformers' cache per call, rows in file order:
the session 33 lease's condition, under which every cache was as long as the longest prompt yet).
TORCH_LOGS names recompiles and CUDA-graph perf hints in its log.  (Eight `dflash generate` processes on
one GPU were measured before: 2,232 tokens/s greedy at 48 rows, 1.7x one process: BENCHMARKS
"`dflash generate` on the real target, alone"; not repeated.)

Env: as session 29's screen.py (SCREEN, STEPS, EVERY, WORKERS, DEADLINE, /root/ex/deadline), BENCH_S
(default 420), BENCH_ARGS (replaces the bench's arguments after --target/--data/--out).
"""

from __future__ import annotations

import importlib.util
import json
import lzma
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for k, v in {"SCREEN": "4K.gen,4K.gen1,4K.gen.s1,4K.len", "STEPS": "4000", "EVERY": "1000", "GEN_GPUS": "0"}.items():
    os.environ.setdefault(k, v)
_spec = importlib.util.spec_from_file_location("screen29", HERE.parent / "2026-12-06-session29/screen.py")
s29 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(s29)
s25, s, lg = s29.s25, s29.s, s29.lg

s25.RUNS.update({"4K.gen1": s29.BASE, "4K.gen.s1": s29.BASE + ["--seed", "1"], "4K.len": s29.BASE})
s25.STORE.update({"4K.gen1": "4kgen1", "4K.gen.s1": "4kgen", "4K.len": "4klen"})
NAMES = s25.NAMES
BENCH = ("--rows 512 --max-prompt-tokens 200 --batch-size 64 --max-new-tokens 256 --temperature 0.8 "
         "--passes 1 --modes on,off:256,off,hf@file")


def stores_gen() -> bool:
    """`stores/4kgen` (both samples) and `stores/4kgen1` (the first), from the carried replies, and
    `stores/4klen`, one at a time (a precompute takes ~49 GB of the GPU at its token budget)."""
    with lzma.open(HERE / "results/gen_4k.jsonl.xz", "rt") as f:
        gen = [line for line in f]
    with open(s.E / "data/train.jsonl") as f:
        first = [line for _, line in zip(range(4000), f)]
    ids = {json.loads(line)["id"] for line in first}  # all of them on the GPU; a dry run's few rows on a CPU
    gen = [g for g in gen if json.loads(g)["id"].rsplit(".s", 1)[0] in ids]
    s.log(f"sampled replies: {len(gen)} carried for the {len(first)} conversations")
    gen1 = [g for g in gen if json.loads(g)["id"].endswith(".s0")]
    for store, rows, extra in (("4kgen", gen, []), ("4kgen1", gen1, []), ("4klen", [], ["--max-length", "4096"])):
        if not any(s25.STORE.get(n) == store for n in NAMES):
            continue
        (s.E / f"data/train_{store}.jsonl").write_text("".join(first + rows))
        if s.run(f"precompute_{store}", s.DF + ["precompute", "--data", f"data/train_{store}.jsonl", "--out",
                                                f"stores/{store}"] + s.ALL_ARGS + extra, 300):
            return False
    return True


def screen() -> None:
    """Session 25's screen loop over this plan's runs (session 29's holds 4K.gen back for its replies)."""
    every = ["--save-every", s25.EVERY, "--eval-every", s25.EVERY, "--eval-store", "stores/online_gen",
             "--eval-walk-tokens", "128"]
    procs = {n: s.bg(f"train_{n}", s.train_cmd(n, s25.STORE[n], s25.STEPS, s25.RUNS[n], every)) for n in NAMES}
    while any(p.poll() is None for p in procs.values()):
        s25.tick(procs)
    for n, p in procs.items():
        s.log(f"train_{n}: exit {p.returncode} at step {s.last_step(n)}")


def bench() -> None:
    left = s25.deadline() - time.time()
    if left < float(os.environ.get("BENCH_S", 420)):
        return s.log(f"bench_generate: skipped, {left:.0f} s left before the deadline")
    os.environ["TORCH_LOGS"] = "recompiles,perf_hints"
    cmd = [sys.executable, str(s.CODE / "bench/generate_rate.py"), "--target", str(s.E / "model"), "--data",
           str(s.E / "data/train.jsonl"), "--out", str(s.E / "generate_rate.jsonl")]
    s.run("bench_generate", cmd + os.environ.get("BENCH_ARGS", BENCH).split(), left - 30)


def main() -> None:
    (s.E / "logs").mkdir(exist_ok=True)
    (s.E / "eval").mkdir(exist_ok=True)
    s.log(f"driver (session 33's plan): {NAMES} at once, {s25.STEPS} steps each, walk on online_gen every "
          f"{s25.EVERY}; then the generate bench; deadline {time.strftime('%H:%M:%S', time.gmtime(s25.deadline()))}")
    if not (s.E / "model/config.json").exists() and s.run("target", [sys.executable, "stages/target.py"], 300):
        return s.log("driver: the target stage failed; stopping")
    online = s25.s24.online_gen()
    if not stores_gen() or not s25.online_gen_store(online):
        return s.log("driver: a store failed; stopping")
    screen()
    bench()
    s.log("driver: done")


if __name__ == "__main__":
    lg.guarded(main)
