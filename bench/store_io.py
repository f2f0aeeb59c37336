"""Store throughput: ShardWriter append+commit, Store.read, verify_store, at a real target's width.

    python bench/store_io.py --out /tmp/bench_store [--hidden-dtype bf16|fp8] [--tokens 200000]
        [--width 20480 --layers 5] [--sample-len 1500] [--hidden-compressor zstd] [--chunk-tokens 64]
        [--pre-encoded] [--io-threads N] [--no-fsync] [--profile] [--own-loops] [--no-fused] [--write-only]
    python bench/store_io.py --out /tmp/bench_store --simulate-forward 8000 [--batch-tokens 16384]

--simulate-forward RATE stands in for the GPU: each batch "computes" for batch_tokens / RATE seconds
(a sleep, which like a CUDA wait releases the GIL), then is written through the old serial path (append
inline) and through precompute's WritePipeline (writer thread); it prints both rates as fractions of RATE.

--pre-encoded appends rows already in stored form (`ShardWriter.append_encoded`, what precompute's
WritePipeline calls: the bf16 cast / fp8 quantisation happen on the GPU there); without it `append`
encodes on the CPU, which dominates fp8 on one core.

Qwen3-8B with 5 captured layers stores 5 x 4096 bf16 = 40 KB of hidden state per token; precompute on
one H200 produces ~30K tokens/s, so a shard writer has to sustain ~1.2 GB/s.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import shutil
import time
from pathlib import Path

import torch
import zarr

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
    ap.add_argument("--pre-encoded", action="store_true", help="append_encoded (stored form, as precompute does)")
    ap.add_argument("--io-threads", type=int, default=None, help="ShardWriter io_threads (default: its own)")
    ap.add_argument("--no-fused", action="store_true",
                    help="ShardWriter(fused_pipeline=False): zarr's default codec pipeline (zarr >= 3.4; same bytes)")
    ap.add_argument("--write-only", action="store_true", help="skip the read and verify passes")
    ap.add_argument("--simulate-forward", type=float, default=None, help="tok/s of a simulated GPU forward")
    ap.add_argument("--batch-tokens", type=int, default=16384)
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
    if a.simulate_forward:
        return simulate(a, manifest, hidden, ids, mask, topk_ids, topk_lp)
    enc = None
    if a.pre_encoded:
        from dflash.store.writer import encode_hidden_tensors

        enc = {k: v.numpy() for k, v in encode_hidden_tensors(hidden, a.hidden_dtype, a.layers).items()}
        enc.update(topk_ids=topk_ids.int().numpy(), topk_logprobs=topk_lp.numpy())
    extra = {} if a.io_threads is None else {"io_threads": a.io_threads}
    extra["fused_pipeline"] = not a.no_fused
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
        **extra,
    ) as w:
        for i in range(n):
            if enc is None:
                w.append(i, i, ids, mask, hidden, topk_ids, topk_lp)
            else:
                w.append_encoded(i, i, ids, mask, enc)
        w.finalize()
    dt = time.perf_counter() - t0
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(8)
    tokens = n * t
    nbytes = sum(f.stat().st_size for f in Path(a.out).rglob("*") if f.is_file())
    pipeline = type(w.arrays["hidden"].async_array.codec_pipeline).__name__
    print(f"write: {tokens / dt:,.0f} tok/s ({nbytes / dt / 1e9:.2f} GB/s of store, {a.hidden_dtype}"
          f"{', pre-encoded' if enc else ''}), objects of {w.S} tokens, zarr {zarr.__version__} {pipeline}"
          f", {w._writes.max_inflight} I/O threads", flush=True)
    if a.write_only:
        shutil.rmtree(a.out)
        return
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


def simulate(a, manifest, hidden, ids, mask, topk_ids, topk_lp) -> None:
    """Serial against pipelined writes behind a simulated forward of `a.simulate_forward` tok/s."""
    from dflash.store.pipeline import WritePipeline

    t = a.sample_len
    per = max(1, a.batch_tokens // t)
    nb = max(1, a.tokens // (per * t))
    bh = hidden.unsqueeze(0).expand(per, -1, -1).contiguous()  # [B, T, W], as Capture returns it
    bids, blp = topk_ids.unsqueeze(0).expand(per, -1, -1), topk_lp.unsqueeze(0).expand(per, -1, -1)
    compute_s = per * t / a.simulate_forward
    for mode in ("serial", "pipelined"):
        create_or_check_manifest(a.out, manifest, overwrite=True)
        w = ShardWriter(a.out, 0, hidden_width=a.width, num_layers=a.layers, hidden_dtype=a.hidden_dtype, topk=a.topk,
                        commit_every_tokens=a.commit_every, durable=not a.no_fsync)
        t0 = time.perf_counter()
        with w, (WritePipeline(w, "cpu", slots=3, capacity_tokens=per * t) if mode == "pipelined" else w) as sink:
            for i in range(nb):
                time.sleep(compute_s)  # the GPU's forward; the host thread waits without the GIL
                h = bh  # the forward's output (on a GPU it lives in device memory)
                if mode == "serial":  # precompute's old _write_batch: copy out, then append each sample
                    for b in range(per):
                        sink.append(i * per + b, i * per + b, ids, mask, h[b], bids[b], blp[b])
                else:
                    samples = [(b, i * per + b, i * per + b, ids, mask) for b in range(per)]
                    sink.submit(samples, h, bids, blp)
            sink.finalize()
        dt = time.perf_counter() - t0
        tokens = nb * per * t
        print(f"{mode:9s}: {tokens / dt:,.0f} tok/s = {tokens / dt / a.simulate_forward:.2f} of the simulated "
              f"forward ({a.simulate_forward:,.0f} tok/s), {tokens} tokens in batches of {per} x {t}")
    shutil.rmtree(a.out)


if __name__ == "__main__":
    main()
