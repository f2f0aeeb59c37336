"""What training's first held-out eval costs with a compiled drafter, by the evals' padded shapes.

    python bench/eval_compile.py RUN STORE --target DIR [--num-shapes 3,1] [--token-budget 4096]
        [--block-budget 1024] [--rows 8] [--max-new-tokens 128] [--out eval_compile.json]

For each --num-shapes value, a fresh process (its own dynamo state and an empty inductor cache) loads
the drafter of RUN, compiles it in place with static shapes as training does, and runs the two evals
training runs at each --eval-every on STORE: `offline_tau` (random anchors) and `walk_tau`, each twice.
It reports each call's seconds (the first includes the compilation of every shape it meets), the graphs
dynamo compiled, and the taus, which must not depend on the padding.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import common  # noqa: F401  (puts the repo root on sys.path)


def one(a, num_shapes: int) -> dict:
    import torch
    from torch._dynamo.utils import counters

    from dflash.evaluate.export import load_training_drafter
    from dflash.store import open_store
    from dflash.target_model.files import load_embed_and_head
    from dflash.train.heldout import offline_tau
    from dflash.train.walk import walk_tau

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    drafter = load_training_drafter(a.run)[0].to(device)
    drafter.compile(dynamic=False)
    embed, head = load_embed_and_head(a.target)
    store = open_store(a.store, require_complete=True)

    def timed(fn, **kw):
        t0 = time.perf_counter()
        res = fn(drafter, embed, head, store, token_budget=a.token_budget, num_shapes=num_shapes, progress=False, **kw)
        return round(time.perf_counter() - t0, 2), res  # each eval ends in host copies: the device is done

    out = {"num_shapes": num_shapes, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    for name, fn, kw in (("offline", offline_tau, {"block_budget": a.block_budget}),
                         ("walk", walk_tau, {"rows_per_batch": a.rows, "max_new_tokens": a.max_new_tokens})):
        before = int(counters["stats"]["unique_graphs"])
        first, res = timed(fn, **kw)
        graphs = int(counters["stats"]["unique_graphs"]) - before
        again, _ = timed(fn, **kw)
        out[name] = {"first_s": first, "again_s": again, "graphs": graphs, "tau": res["tau"], "blocks": res["num_blocks"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("store")
    ap.add_argument("--target", required=True)
    ap.add_argument("--num-shapes", default="3,1")
    ap.add_argument("--token-budget", type=int, default=4096)
    ap.add_argument("--block-budget", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # the child process
    a = ap.parse_args()
    if a.one is not None:
        print(json.dumps(one(a, a.one)))
        return
    results = []
    for n in [int(x) for x in a.num_shapes.split(",")]:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
            child = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", str(n)], env=env,
                                   capture_output=True, text=True, check=True)
        results.append(json.loads(child.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
