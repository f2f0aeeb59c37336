"""How much of a block `--labels rollout` keeps on real data: the target's greedy token against the data's.

    python bench/rollout_labels.py TARGET DATA.jsonl [--conversations 40] [--block-size 16] [--anchors 64]

Renders the first conversations as precompute does (dflash.chat.render, max length 2048), runs the target on
each (CPU is fine for a 135M target) for its greedy token at every position, then draws anchors and blocks
as the loader does (loader.draw_anchors, block_targets) and counts the supervised block positions under
`--labels target` and under `--labels rollout` (loader.rollout_reach).  Prints how often the data's
supervised tokens equal the target's greedy token, the supervised positions per block both ways, and the
share of blocks `rollout` supervises at each block position.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

import common  # noqa: F401  (puts the repo root on sys.path)
from dflash.chat import render
from dflash.train import loader as L
from dflash.train.loss import IGNORE


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("data")
    ap.add_argument("--conversations", type=int, default=40)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--anchors", type=int, default=64)
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.target)
    model = AutoModelForCausalLM.from_pretrained(a.target, dtype=torch.float32).eval()
    B, t0 = a.block_size, time.time()
    agree, per_k = [], {"target": np.zeros(B), "rollout": np.zeros(B)}
    with open(a.data, encoding="utf-8") as f:
        rows = [json.loads(next(f)) for _ in range(a.conversations)]
    for i, row in enumerate(rows):
        r = render(tok, row["messages"], 2048)
        ids, lm = np.asarray(r.input_ids), np.asarray(r.loss_mask).astype(bool)
        with torch.no_grad():
            top1 = model(input_ids=torch.tensor(ids)[None]).logits[0].argmax(-1).numpy()
        agree.append((ids[1:] == top1[:-1])[lm[1:]])
        anchors = L.draw_anchors(lm, a.anchors, 0, 0, i)
        blocks = L.block_targets(ids, lm, anchors, B, 0, np.ones(B))
        target = L.target_labels(blocks, top1[:, None]).reshape(-1, B) != IGNORE
        rollout = target & L.rollout_reach(blocks, ids, top1[:, None], B).reshape(-1, B)
        per_k["target"] += target.sum(0)
        per_k["rollout"] += rollout.sum(0)
    blocks_n = per_k["target"][1]
    print(f"{a.conversations} conversations in {time.time() - t0:.0f} s; the data's supervised tokens equal the "
          f"target's greedy token {np.concatenate(agree).mean():.3f} of the time")
    print(f"supervised block positions per block: --labels target {per_k['target'].sum() / blocks_n:.2f}, "
          f"--labels rollout {per_k['rollout'].sum() / blocks_n:.2f}")
    print("share of blocks --labels rollout supervises at k = 1..B-1:",
          np.round(per_k["rollout"][1:] / blocks_n, 3).tolist())


if __name__ == "__main__":
    main()
