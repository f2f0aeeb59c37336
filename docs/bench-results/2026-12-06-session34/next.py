"""Session 34's plan for the next lease: the sampled replies for all 17K conversations, and the 4K screen's next arms.

Session 34's lease measured, on the first 4,000 training conversations (4,000-step cosines, four runs
sharing an H100), that two sampled replies of the target a conversation lift online tau at the plateau
from 2.005 to 2.096 and 2.137 (two seeds), one reply by 0.03, and cutting at 4,096 tokens not at all.
It also measured `dflash generate --static-cache on` at 8.8K tokens/s once compiled.  So this lease makes
the data for the 17K run and screens two more levers on 4K:

  gen_4k23   2 more sampled replies (`.s2`, `.s3`) to the first exchange of each of the first 4,000
             conversations (`--seed 1`; `.s0`/`.s1` are session 33's, carried in its results)
  gen_17k    2 sampled replies (`.s0`, `.s1`, `--seed 2`) to each of the other 13,129 conversations' first
             exchange: with session 33's, 2 for every one of the 17,129; it comes back compressed in
             `out/`, so the lease after trains on all 17K + 34K replies without generating
  4K.gen4    BASE on `stores/4kgen4`: the 4,000 conversations and 4 sampled replies to each
  4K.gen.6k  4K.gen (BASE on `stores/4kgen`: 2 sampled replies a conversation) for a 6,000-step cosine:
             with 3x the samples, 4,000 steps were ~9 epochs against the baseline's ~21, and 4K.gen still
             gained 0.02-0.03 over its last 1,000 steps; whether more steps pay decides the length of the
             17K run (`after.py`: 20,000 steps are ~8 epochs of 17K conversations + 34K replies)
  4K.b8      BASE with `--block-size 8` on `stores/4k`: block 8 against 16 online (tau is capped at 8)
  4K.gen4.s1 4K.gen4 with `--seed 1` (not in the default SCREEN; 4K.gen's two seeds were 0.041 apart)

Sampling as session 33's: temperature 0.8, at most GEN_TOKENS (256) new tokens, `--static-cache on`,
GEN_BATCH_REPLIES (128) rows a batch, one process on GPU 0.  gen_4k23 goes first (4K.gen4 waits on it), then
gen_17k runs beside the trainers.  If the deadline comes first, the rows finished so far are taken from
generate's journal into `out/gen_17k.partial.jsonl.xz` (the next lease generates the rest).

Env: as session 29's screen.py (SCREEN, STEPS, EVERY, WORKERS, DEADLINE, /root/ex/deadline), GEN_BATCH_REPLIES,
GEN_TOKENS, GEN_GPUS, GEN_EXTRA (replaces `--static-cache on`), STEPS_6K (4K.gen.6k's steps), N4K (the 4K subset's size, default 4000:
a dry run's few rows).
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
for k, v in {"SCREEN": "4K.gen4,4K.gen.6k,4K.b8", "STEPS": "4000", "EVERY": "1000", "GEN_GPUS": "0"}.items():
    os.environ.setdefault(k, v)
_spec = importlib.util.spec_from_file_location("screen29", HERE.parent / "2026-12-06-session29/screen.py")
s29 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(s29)
s25, s, lg = s29.s25, s29.s, s29.lg

s25.RUNS.update({"4K.gen4": s29.BASE, "4K.gen4.s1": s29.BASE + ["--seed", "1"],
                 "4K.b8": s29.BASE + ["--block-size", "8"], "4K.gen.6k": s29.BASE})
s25.STORE.update({"4K.gen4": "4kgen4", "4K.gen4.s1": "4kgen4", "4K.b8": "4k", "4K.gen.6k": "4kgen"})
STEPS_OF = {"4K.gen.6k": int(os.environ.get("STEPS_6K", 6000))}
NAMES = s25.NAMES
N4K = int(os.environ.get("N4K", 4000))
CARRIED = HERE.parent / "2026-12-06-session33/results/gen_4k.jsonl.xz"
OUT = s.E / "out"


def conversations() -> list[str]:
    with open(s.E / "data/train.jsonl") as f:
        return f.readlines()


def generate(name: str, rows: list[str], samples: range, seed: int):
    """Background: `dflash generate` of `samples` sampled replies to each row's first exchange."""
    with open(s.E / f"data/prompts_{name}.jsonl", "w") as out:
        for k in samples:
            for line in rows:
                r = json.loads(line)
                out.write(json.dumps({"id": f"{r['id']}.s{k}", "messages": r["messages"][:2]}, ensure_ascii=False) + "\n")
    extra = os.environ.get("GEN_EXTRA", "--static-cache on").split()
    return s.bg(f"generate_{name}", s.DF + [
        "generate", "--data", f"data/prompts_{name}.jsonl", "--out", f"data/{name}.jsonl", "--turns", "last",
        "--max-new-tokens", os.environ.get("GEN_TOKENS", "256"), "--temperature", "0.8", "--seed", str(seed),
        "--batch-size", os.environ.get("GEN_BATCH_REPLIES", "128"), "--gpus", os.environ.get("GEN_GPUS", "0"),
        "--overwrite"] + extra)


def carried(first: list[str]) -> list[str]:
    """Session 33's sampled replies to these conversations (all 4,000 on the GPU; a dry run's few)."""
    ids = {json.loads(line)["id"] for line in first}
    with lzma.open(CARRIED, "rt") as f:
        return [g for g in f if json.loads(g)["id"].rsplit(".s", 1)[0] in ids]


def precompute_4kgen4(first: list[str]):
    """Background: `stores/4kgen4`, the 4K conversations and their 4 sampled replies (2 carried, 2 new)."""
    old = carried(first)
    new = (s.E / "data/gen_4k23.jsonl").read_text()
    (s.E / "data/train_4kgen4.jsonl").write_text("".join(first + old) + new)
    s.log(f"stores/4kgen4: {len(first)} conversations, {len(old)} carried replies, {new.count(chr(10))} new")
    return s.bg("precompute_4kgen4", s.DF + ["precompute", "--data", "data/train_4kgen4.jsonl", "--out",
                                            "stores/4kgen4"] + s.ALL_ARGS)


def store_4kgen(first: list[str]) -> bool:
    """`stores/4kgen`: the 4K conversations and session 33's 2 sampled replies to each (session 34's store)."""
    if not any(s25.STORE[n] == "4kgen" for n in NAMES):
        return True
    (s.E / "data/train_4kgen.jsonl").write_text("".join(first + carried(first)))
    return s.run("precompute_4kgen", s.DF + ["precompute", "--data", "data/train_4kgen.jsonl", "--out",
                                            "stores/4kgen"] + s.ALL_ARGS, 300) == 0


def keep(name: str, partial: bool = False) -> None:
    """The replies into out/, xz-compressed; a stopped run's finished rows from its journal."""
    OUT.mkdir(exist_ok=True)
    src = s.E / f"data/{name}.jsonl"
    if partial:
        from dflash.generate.journal import load_records, output_bytes, work_dir
        rows = sum(1 for _ in open(s.E / f"data/prompts_{name}.jsonl"))
        data = output_bytes(load_records(work_dir(src)), rows)
        name += ".partial"
    else:
        data = src.read_bytes()
    with lzma.open(OUT / f"{name}.jsonl.xz", "wb", preset=6) as f:
        f.write(data)
    n = data.count(b"\n")
    s.log(f"kept {OUT.name}/{name}.jsonl.xz: {n} replies")


def screen(gen23, convs: list[str]) -> None:
    """The runs, each started once its store is written; gen_17k started after gen_4k23."""
    every = ["--save-every", s25.EVERY, "--eval-every", s25.EVERY, "--eval-store", "stores/online_gen",
             "--eval-walk-tokens", "128"]
    start = lambda n: s.bg(f"train_{n}", s.train_cmd(n, s25.STORE[n], STEPS_OF.get(n, s25.STEPS), s25.RUNS[n], every))  # noqa: E731
    procs = {n: start(n) for n in NAMES if s25.STORE[n] != "4kgen4"}  # 4K.gen4 waits for its replies
    gen17 = pre = None
    while gen23 or gen17 or pre or any(p.poll() is None for p in procs.values()):
        if gen23 and gen23.poll() is not None:
            s.log(f"generate_gen_4k23: exit {gen23.returncode}")
            if gen23.returncode == 0:
                keep("gen_4k23")
                if any(s25.STORE[n] == "4kgen4" for n in NAMES):
                    pre = precompute_4kgen4(convs[:N4K])
            gen17, gen23 = generate("gen_17k", convs[N4K:], range(2), 2), None
        if pre and pre.poll() is not None:
            s.log(f"precompute_4kgen4: exit {pre.returncode}")
            if pre.returncode == 0 and time.time() < s25.deadline():
                procs.update({n: start(n) for n in NAMES if s25.STORE[n] == "4kgen4"})
            pre = None
        if gen17 and gen17.poll() is not None:
            s.log(f"generate_gen_17k: exit {gen17.returncode}")
            keep("gen_17k", partial=gen17.returncode != 0)
            gen17 = None
        if s25.tick(procs):
            for p in (gen23, pre, gen17):
                if p:
                    s.stop(p)
            if gen17:
                keep("gen_17k", partial=True)
            gen23 = pre = gen17 = None
    for n, p in procs.items():
        s.log(f"train_{n}: exit {p.returncode} at step {s.last_step(n)}")


def main() -> None:
    (s.E / "logs").mkdir(exist_ok=True)
    (s.E / "eval").mkdir(exist_ok=True)
    s.log(f"driver (session 34's plan): {NAMES}, {s25.STEPS} steps each but {STEPS_OF}, walk on online_gen every {s25.EVERY}; "
          f"gen_4k23 then gen_17k; deadline {time.strftime('%H:%M:%S', time.gmtime(s25.deadline()))}")
    if not (s.E / "model/config.json").exists() and s.run("target", [sys.executable, "stages/target.py"], 300):
        return s.log("driver: the target stage failed; stopping")
    convs = conversations()
    online = s25.s24.online_gen()
    gen23 = generate("gen_4k23", convs[:N4K], range(2, 4), 1)
    if not s25.store_4k() or not store_4kgen(convs[:N4K]) or not s25.online_gen_store(online):
        return s.log("driver: a store failed; stopping")
    screen(gen23, convs)
    s.log("driver: done")


if __name__ == "__main__":
    lg.guarded(main)
