"""The workload of bench/precompute_bench.py: a random-init target of a real shape built on the GPU, synthetic
samples cut into precompute's batch plan, and capture + write through precompute's own sink (the writer
process or thread), plus the first capture for before/after comparisons."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

import common  # noqa: F401  (puts the repo root on sys.path)
from common import dims, sync

TOPK = 8


def build_target(tiny: bool, device: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    d = dims(tiny)
    cfg = Qwen3Config(hidden_size=d["hidden_size"], num_hidden_layers=d["num_hidden_layers"],
                      num_attention_heads=d["num_attention_heads"], num_key_value_heads=d["num_key_value_heads"],
                      head_dim=d["head_dim"], intermediate_size=d["intermediate_size"], vocab_size=d["vocab_size"],
                      max_position_embeddings=40960, tie_word_embeddings=False, attn_implementation="sdpa")
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32  # target.resolve_dtype
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):  # parameters are created and initialised on the GPU
            model = Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    return model.eval().requires_grad_(False)


def capture_before_class():
    """Capture with the first top-k path, for a before/after in one run: fp32 log_softmax over every
    chunk of logits, then top-k on it, and real positions picked by boolean indexing on the device (a
    host sync per indexing)."""
    from dflash.target_model.capture import Capture

    class CaptureBefore(Capture):
        def topk_of(self, last_hidden, lengths):
            B, T, _ = last_hidden.shape
            dev = last_hidden.device
            valid = torch.arange(T, device=dev)[None, :] < torch.as_tensor(lengths).to(dev)[:, None]
            flat = last_hidden[valid]
            head = self.model.get_output_embeddings()
            ids = torch.zeros(B, T, self.topk, dtype=torch.int64, device=dev)
            logprobs = torch.zeros(B, T, self.topk, dtype=torch.float32, device=dev)
            out_ids, out_lp = [], []
            for s in range(0, flat.shape[0], self.lm_head_chunk):
                logits = head(flat[s : s + self.lm_head_chunk]).float()
                lp, ix = torch.log_softmax(logits, dim=-1).topk(self.topk, dim=-1)
                out_ids.append(ix)
                out_lp.append(lp)
            ids[valid] = torch.cat(out_ids)
            logprobs[valid] = torch.cat(out_lp)
            return ids, logprobs

    return CaptureBefore


def sequences(tiny: bool, tokens: int, vocab: int, seed: int = 0):
    """Synthetic rendered samples (dflash.chat.Rendered) of 300-4096 tokens (20-200 tiny)."""
    from dflash.chat import Rendered

    rng = np.random.default_rng(seed)
    lo, hi = (20, 200) if tiny else (300, 4096)
    out, total = [], 0
    while total < tokens:
        n = int(rng.integers(lo, hi + 1))
        ids = rng.integers(0, vocab, n).tolist()
        mask = [0] * (n // 5) + [1] * (n - n // 5)
        out.append(Rendered(input_ids=ids, loss_mask=mask, truncated=False))
        total += n
    return out


def batches_of(samples, token_budget: int):
    """[(members [(row, Rendered)], padded ids [B, T], lengths [B])] in precompute's batch plan."""
    from dflash.precompute.shard import plan_batches

    out = []
    for idx in plan_batches([len(s.input_ids) for s in samples], token_budget):
        members = [(i, samples[i]) for i in idx]
        lengths = [len(s.input_ids) for _, s in members]
        ids = torch.zeros(len(members), max(lengths), dtype=torch.long)
        for b, (_, s) in enumerate(members):
            ids[b, : lengths[b]] = torch.tensor(s.input_ids)
        out.append((members, ids, torch.tensor(lengths)))
    return out


def write_batch(sink, capture, members, device, hidden_dtype: str) -> None:
    """precompute's own write step (every member is new: todo = members)."""
    from dflash.precompute import shard

    todo = [(j, r, rd) for j, (r, rd) in enumerate(members)]
    shard._write_batch(sink, capture, members, todo, device, 0)


def make_store(path: Path, tiny: bool, hidden_dtype: str, num_shards: int) -> None:
    from dflash.store import create_or_check_manifest

    d = dims(tiny)
    create_or_check_manifest(path, {
        "target": {"config_hash": "bench", "hidden_size": d["hidden_size"], "num_hidden_layers": d["num_hidden_layers"],
                   "vocab_size": d["vocab_size"]},
        "tokenizer_hash": "bench", "dataset_fingerprint": "bench", "target_layer_ids": d["target_layer_ids"],
        "hidden_dtype": hidden_dtype, "topk": TOPK, "max_length": 4096, "num_shards": num_shards,
    }, overwrite=True)


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def capture_and_write(capture, batches, store: Path, shard: int, tiny: bool, device: str, hidden_dtype: str,
                      mode: str = "process", budget: int = 0, io_threads: int = 4, stats: dict | None = None) -> float:
    """Seconds to capture and write every batch into one shard, finalize (fsync, index) included, through
    precompute's sink (`precompute_shard.open_sink`): mode "process" (the writer process run_shard uses),
    or "thread" (the writer thread).  The sink's start-up (the writer process starting and
    opening the shard, paid once per shard) is outside the timed span, in stats["writer_start_s"]."""
    from dflash.precompute.shard import open_sink

    d = dims(tiny)
    L = len(d["target_layer_ids"])
    capacity = max([budget] + [ids.numel() for _, ids, _ in batches])
    args = dict(store_path=store, shard_index=shard, hidden_width=L * d["hidden_size"], num_layers=L,
                hidden_dtype=hidden_dtype, topk=TOPK, io_threads=io_threads)
    t0 = time.perf_counter()
    with open_sink(args, device, mode, 3, capacity) as sink:
        start_s = time.perf_counter() - t0
        sync(device)
        t = time.perf_counter()
        for members, _, _ in batches:
            write_batch(sink, capture, members, device, hidden_dtype)
        sync(device)
        t_last = time.perf_counter()  # the GPU is done: what follows is the store catching up
        sink.finalize({"bench": True})
    sync(device)
    end = time.perf_counter()
    if stats is not None:
        stats["drain_s"] = round(end - t_last, 2)
        stats["writer_start_s"] = round(start_s, 2)
        stats["gpu_waited_for_store_s"] = round(getattr(sink, "stall_s", 0.0), 2)
    return end - t


def background_writer(store: str, tiny: bool, tokens_per_s: float, stop, ready, report=None) -> None:
    """A ShardWriter appending synthetic bf16 samples at `tokens_per_s` until `stop` is set: the store's
    write load without the GPU, beside a capture pass (bench pass capture_bg_thread / capture_bg_process).
    In a thread it shares the capturing process's GIL, in a process it does not; the difference is what
    the GIL costs the capture."""
    from dflash.store import ShardWriter

    torch.set_num_threads(1)
    d = dims(tiny)
    L = len(d["target_layer_ids"])
    W = L * d["hidden_size"]
    rng = np.random.default_rng(1)
    T = 64 if tiny else 1500
    hidden = rng.integers(-2**15, 2**15, (T, W), dtype=np.int16)
    arrays = {"hidden": hidden, "topk_ids": rng.integers(0, d["vocab_size"], (T, TOPK)).astype(np.int32),
              "topk_logprobs": rng.standard_normal((T, TOPK)).astype(np.float32)}
    ids, mask = list(range(T)), [1] * T
    n = 0
    with ShardWriter(store, 0, hidden_width=W, num_layers=L, hidden_dtype="bf16", topk=TOPK) as w:
        ready.set()
        t0 = time.perf_counter()
        while not stop.is_set():
            ahead = n / tokens_per_s - (time.perf_counter() - t0)
            if ahead > 0:
                time.sleep(min(ahead, 0.05))
                continue
            w.append_encoded(n // T, n // T, ids, mask, arrays)
            n += T
        dt = time.perf_counter() - t0
    if report is not None:
        report.put({"tokens": n, "s": round(dt, 2), "tokens_per_s": round(n / max(dt, 1e-9))})
