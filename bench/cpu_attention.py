"""The CPU training path's attention on one packed row: dense-masked SDPA against `attention.tiled_sdpa`
(only the key tiles each query tile sees), forward + backward, and their largest difference.

    python bench/cpu_attention.py [--samples 5] [--anchors 64] [--block 8] [--ctx 2048] [--reps 3]

The row is the embedded default's shape: `--samples` conversations packed into `--ctx` context tokens,
`--anchors` blocks of `--block` each, 4 query heads / 2 KV heads of 64 (the drafter of params.yaml).
Prints one JSON line."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import torch.nn.functional as F

from dflash.drafter import attention, masks


def packed_row(samples: int, anchors: int, block: int, ctx: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    lens = np.full(samples, ctx // samples) - rng.integers(0, 60, samples)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    b_sample, b_anchor = [], []
    for i, n in enumerate(lens):
        b_sample += [i] * anchors
        b_anchor += sorted(rng.choice(np.arange(1, n - block), anchors, replace=False).tolist())
    q = -(-len(b_sample) * block // masks.TILE) * masks.TILE
    return masks.mask_metadata(starts, lens, np.array(b_sample), np.array(b_anchor), block, ctx, q)


def dense_sdpa(q, k, v, mask, scale):
    rows_on = mask.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~rows_on, scale=scale, enable_gqa=True)
    return out.masked_fill(~rows_on, 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    mask = masks.to_dense_mask(packed_row(a.samples, a.anchors, a.block, a.ctx))
    Q, K = mask.shape[-2:]
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(1, h, n, 64, generator=g, requires_grad=True) for h, n in ((4, Q), (2, K), (2, K))]
    result = {"Q": Q, "K": K, "visible_fraction": round(mask.float().mean().item(), 4),
              "threads": torch.get_num_threads()}
    outs = {}
    for name, fn in (("dense", dense_sdpa), ("tiled", attention.tiled_sdpa)):
        t0 = time.perf_counter()
        for _ in range(a.reps):
            out = fn(*leaves, mask, 0.125)
            grads = torch.autograd.grad(out.square().sum(), leaves)
        result[f"{name}_fwd_bwd_s"] = round((time.perf_counter() - t0) / a.reps, 4)
        outs[name] = [out.detach(), *grads]
    result["max_abs_diff"] = max((x - y).abs().max().item() for x, y in zip(outs["dense"], outs["tiled"]))
    result["speedup"] = round(result["dense_fwd_bwd_s"] / result["tiled_fwd_bwd_s"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
