"""The store's write path alone, as `dflash precompute` drives it, fed synthetic capture output: tokens/s,
bytes/s and where the writer's time goes.  Runs on a CPU (no target, no GPU).

    python bench/write_rate.py [--shape smollm2-135m|qwen3-8b|tiny] [--tokens 1500000] [--sample-len 1300]
        [--token-budget 65536] [--dir /tmp] [--writer process|thread] [--commit-every 32768]
        [--out $OUT/write_rate.json]

Samples of `sample-len` +- 70% tokens (uniform) are cut into precompute's batch plan (`plan_batches`) and
handed, batch by batch, to the sink `run_shard` uses (`dflash.precompute.shard.open_sink`: the writer
process by default) with `submit()`, as `_write_batch` does after a capture: a [B, T, L*H] bf16 hidden
tensor and [B, T, K] top-k, right-padded.  Their contents are random bits made once and reused (hidden is
stored uncompressed; the small arrays' codecs see random values).  Nothing else runs meanwhile, so the
rate is the most the store path can take: a capture faster than it waits for the store.

Reported: the wall time from the first submit to the end of finalize (`tok_per_s`, `mb_per_s` of stored
bytes), the time `submit()` spent copying into the write slots (on a GPU: queuing the device-to-host
copies) and waiting for a free slot (`stall_s`: a capture would have waited that long), and the writer's
own per-stage seconds (`writer_s`, from the shard's status: ShardWriter.stage_times) and, with the writer
process, its CPU seconds (`writer_cpu_s`, start-up included) per GB stored.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import common  # noqa: F401  (puts the repo root on sys.path)
from dflash.chat import Rendered
from dflash.precompute.shard import open_sink, plan_batches
from dflash.store import create_or_check_manifest
from dflash.store.manifest import shard_status

TOPK = 8
SHAPES = {"smollm2-135m": (576, 3), "qwen3-1.7b": (2048, 3), "qwen3-8b": (4096, 3), "tiny": (64, 2)}


def samples_of(tokens: int, mean_len: int, seed: int = 0) -> list[Rendered]:
    rng = np.random.default_rng(seed)
    lo, hi = max(2, int(mean_len * 0.3)), int(mean_len * 1.7)
    out, total = [], 0
    while total < tokens:
        n = int(rng.integers(lo, hi + 1))
        out.append(Rendered(input_ids=rng.integers(0, 32000, n).tolist(), loss_mask=[0] * (n // 5) + [1] * (n - n // 5),
                            truncated=False))
        total += n
    return out


def make_store(path: Path, hidden: int, layers: int) -> None:
    create_or_check_manifest(path, {
        "target": {"config_hash": "bench", "hidden_size": hidden, "num_hidden_layers": 30, "vocab_size": 32000},
        "tokenizer_hash": "bench", "dataset_fingerprint": "bench", "target_layer_ids": list(range(layers)),
        "hidden_dtype": "bf16", "topk": TOPK, "max_length": 8192, "num_shards": 1,
    }, overwrite=True)


def run(a) -> dict:
    H, L = SHAPES[a.shape]
    W = L * H
    samples = samples_of(a.tokens, a.sample_len)
    batches = plan_batches([len(s.input_ids) for s in samples], a.token_budget)
    capacity = max(a.token_budget, max(len(s.input_ids) for s in samples))
    g = torch.Generator().manual_seed(0)
    # one random pool, viewed as each batch's [B, T, ...] (B * T <= capacity by the plan)
    hidden = torch.randint(-2**15, 2**15, (capacity * W,), dtype=torch.int16, generator=g).view(torch.bfloat16)
    top_ids = torch.randint(0, 32000, (capacity * TOPK,), generator=g)
    top_lp = -torch.rand(capacity * TOPK, generator=g) * 10
    root = Path(tempfile.mkdtemp(prefix="write_rate_", dir=a.dir))
    store = root / "store"
    try:
        make_store(store, H, L)
        args = dict(store_path=store, shard_index=0, hidden_width=W, num_layers=L, hidden_dtype="bf16", topk=TOPK,
                    commit_every_tokens=a.commit_every, **({"direct_objects": False} if a.zarr_objects else {}))
        t_open = time.perf_counter()
        submit_s = 0.0
        with open_sink(args, "cpu", a.writer, 3, capacity) as sink:
            start_s = time.perf_counter() - t_open
            t0 = time.perf_counter()
            for batch in batches:
                B, T = len(batch), len(samples[batch[0]].input_ids)
                todo = [(b, i, i, samples[i].input_ids, samples[i].loss_mask) for b, i in enumerate(batch)]
                ts = time.perf_counter()
                sink.submit(todo, hidden[: B * T * W].view(B, T, W), top_ids[: B * T * TOPK].view(B, T, TOPK),
                            top_lp[: B * T * TOPK].view(B, T, TOPK))
                submit_s += time.perf_counter() - ts
            t_sub = time.perf_counter()
            sink.finalize({"bench": "write_rate"})
        wall = time.perf_counter() - t0
        st = shard_status(store, 0)
        nbytes = sum(f.stat().st_size for f in (store / "shard-00000").rglob("*") if f.is_file())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    tokens = st["num_tokens"]
    cpu = st.get("writer_cpu_s") or {}
    return {"shape": a.shape, "width": W, "writer": a.writer, "zarr_objects": a.zarr_objects, "dir": a.dir, "tokens": tokens,
            "samples": st["num_samples"], "batches": len(batches), "token_budget": a.token_budget,
            "commit_every": a.commit_every, "bytes_per_token": round(nbytes / tokens, 1),
            "wall_s": round(wall, 3), "tok_per_s": round(tokens / wall), "mb_per_s": round(nbytes / wall / 1e6, 1),
            "submit_s": round(submit_s - getattr(sink, "stall_s", 0.0), 3),
            "stall_s": round(getattr(sink, "stall_s", 0.0), 3), "drain_s": round(time.perf_counter() - t_sub, 3),
            "writer_start_s": round(start_s, 3), "writer_s": st.get("writer_s"),
            "writer_cpu_s": cpu or None,
            # the writer process's CPU per GB stored: steadier than the wall rate on a shared machine
            "writer_cpu_s_per_gb": round((cpu["user"] + cpu["sys"]) / (nbytes / 1e9), 2) if cpu else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=1_500_000)
    ap.add_argument("--sample-len", type=int, default=1300)
    ap.add_argument("--token-budget", type=int, default=65536)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the temporary store goes (its disk is timed)")
    ap.add_argument("--writer", default="process", choices=("process", "thread"))
    ap.add_argument("--commit-every", type=int, default=32768)
    ap.add_argument("--zarr-objects", action="store_true", help="whole objects through zarr (ShardWriter(direct_objects=False))")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(1)
    res = run(a)
    print(json.dumps(res), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
