"""Store throughput: ShardWriter append+commit, Store.read, verify_store, at a real target's width.

    python bench/store_io.py --out /tmp/bench_store [--hidden-dtype bf16|fp8] [--tokens 200000]
        [--width 20480 --layers 5] [--sample-len 1500] [--hidden-compressor zstd] [--chunk-tokens 64]

Qwen3-8B with 5 captured layers stores 5 x 4096 bf16 = 40 KB of hidden state per token; precompute on
one H200 produces ~30K tokens/s, so a shard writer has to sustain ~1.2 GB/s.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import shutil
import time

import torch

from dflash.store import ShardWriter, create_or_check_manifest, open_store, verify_store


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--hidden-dtype", default="bf16")
    ap.add_argument("--tokens", type=int, default=200_000)
    ap.add_argument("--width", type=int, default=5 * 4096)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--sample-len", type=int, default=1500)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--chunk-tokens", type=int, default=None)
    ap.add_argument("--hidden-compressor", default=None)
    ap.add_argument("--commit-every", type=int, default=32768)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-fsync", action="store_true", help="durable=False: what the disk's fsync costs")
    a = ap.parse_args()
    torch.set_num_threads(1)
    manifest = {
        "target": {"config_hash": "bench", "hidden_size": a.width // a.layers, "num_hidden_layers": 36, "vocab_size": 151936},
        "tokenizer_hash": "bench",
        "dataset_fingerprint": "bench",
        "target_layer_ids": list(range(a.layers)),
        "hidden_dtype": a.hidden_dtype,
        "topk": a.topk,
        "max_length": a.sample_len,
        "num_shards": 1,
    }
    create_or_check_manifest(a.out, manifest, overwrite=True)
    t = a.sample_len
    # activation-like: per-channel scales spanning orders of magnitude
    hidden = (torch.randn(t, a.width) * torch.exp(torch.randn(a.width))).bfloat16()
    ids, mask = torch.randint(0, 151936, (t,)), torch.ones(t, dtype=torch.uint8)
    topk_ids, topk_lp = torch.randint(0, 151936, (t, a.topk)), -torch.rand(t, a.topk)
    n = max(1, a.tokens // t)
    t0 = time.perf_counter()
    prof = cProfile.Profile() if a.profile else None
    if prof:
        prof.enable()
    with ShardWriter(
        a.out,
        0,
        hidden_width=a.width,
        num_layers=a.layers,
        hidden_dtype=a.hidden_dtype,
        topk=a.topk,
        commit_every_tokens=a.commit_every,
        chunk_tokens=a.chunk_tokens,
        hidden_compressor=a.hidden_compressor,
        durable=not a.no_fsync,
    ) as w:
        for i in range(n):
            w.append(i, i, ids, mask, hidden, topk_ids, topk_lp)
        w.finalize()
    dt = time.perf_counter() - t0
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(8)
    tokens = n * t
    print(f"write: {tokens / dt:,.0f} tok/s ({tokens * a.width * 2 / dt / 1e9:.2f} GB/s of bf16 hidden), objects of {w.S} tokens")
    s = open_store(a.out)
    t0 = time.perf_counter()
    for sid in s.sample_ids():
        s.read(sid)
    dt = time.perf_counter() - t0
    print(f"read:  {tokens / dt:,.0f} tok/s, one process, whole samples")
    t0 = time.perf_counter()
    rep = verify_store(a.out)
    print(f"verify: {time.perf_counter() - t0:.1f}s  {rep.summary()}")
    shutil.rmtree(a.out)


if __name__ == "__main__":
    main()
