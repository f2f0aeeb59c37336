"""What the walk (training's `eval_walk_tau`) costs at each micro-batch size, on one checkpoint and store.

    python bench/walk_speed.py RUN STORE --target DIR [--rows 8,32,128] [--token-budget 4096]
        [--block-budget N] [--max-new-tokens 128] [--repeat 2] [--compile] [--out walk_speed.json]

Loads the drafter of RUN (a run or checkpoint directory) and times `dflash.train.walk.walk_tau` over STORE
(the target's own greedy replies) with `rows_per_batch` at each value of --rows: the rows of context one
drafter forward carries.  Training passes its own `--rows-per-batch` (8 in the example), so each step of
the walk runs a forward for every micro-batch that still has a reply being walked.  The first call of
each size is a warm-up (with --compile, the drafter is compiled in place with static shapes as training
compiles it, so that call also compiles); the best of --repeat timed calls is reported, with the walk's
tau and steps, which must not depend on the batching.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import common  # noqa: F401  (puts the repo root on sys.path)
from dflash.evaluate.export import load_training_drafter
from dflash.store import open_store
from dflash.target_model.files import load_embed_and_head
from dflash.train.walk import walk_tau


def timed(drafter, embed, head, store, rows: int, a) -> tuple[float, dict]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = walk_tau(drafter, embed, head, store, max_new_tokens=a.max_new_tokens, token_budget=a.token_budget,
                   rows_per_batch=rows, block_budget=a.block_budget, progress=False)
    return time.perf_counter() - t0, res  # walk_tau ends in host copies of its results: the GPU is done


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("store")
    ap.add_argument("--target", required=True)
    ap.add_argument("--rows", default="8,32,128")
    ap.add_argument("--token-budget", type=int, default=4096)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--block-budget", type=int, default=None,
                    help="block tokens a row; the token budget reproduces the walk before session 26 (padded)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    drafter, ckpt, _ = load_training_drafter(a.run)
    drafter.to(device)
    if a.compile:
        drafter.compile(dynamic=False)
    embed, head = load_embed_and_head(a.target)
    store = open_store(a.store, require_complete=True)
    out = {"checkpoint": str(ckpt), "store": a.store, "device": torch.cuda.get_device_name() if device.type == "cuda"
           else "cpu", "token_budget": a.token_budget, "block_budget": a.block_budget, "max_new_tokens": a.max_new_tokens, "compile": a.compile,
           "sizes": {}}
    for rows in [int(r) for r in a.rows.split(",")]:
        first, res = timed(drafter, embed, head, store, rows, a)
        times = [timed(drafter, embed, head, store, rows, a)[0] for _ in range(a.repeat)]
        out["sizes"][rows] = {"first_s": round(first, 3), "best_s": round(min(times), 3), "all_s": [round(t, 3) for t in times],
                              "tau": res["tau"], "steps": res["num_blocks"], "replies": res["num_samples"],
                              "too_long": res["num_too_long"]}
        print(f"rows_per_batch {rows}: first {first:.2f} s, best {min(times):.2f} s; tau {res['tau']:.4f} over "
              f"{res['num_blocks']} steps of {res['num_samples']} replies", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
