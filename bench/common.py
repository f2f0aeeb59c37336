"""Shared pieces of the benchmark scripts: shapes, result files, a fake 8B-shaped target, the summary.

Every part writes one JSON file `$OUT/<part>.json`, rewritten atomically after each measurement, so a part
killed by its time limit still leaves what it measured; `bench/run.py` collects them into one record.
`python bench/common.py summarize` merges them into `$OUT/results.json` and prints a table.  `--tiny` (or BENCH_TINY=1) shrinks every shape so the whole suite
runs on a laptop CPU in a few minutes; the code path is the same.

Result keys (times in ms or s as named, rates per second of wall time):
  train_step.json  flex (the step as dflash.train.trainer runs it) / flex_old, flex_fused_only (before) /
                   baseline_create_block_mask / rowsN: step_ms_wall_mean, step_ms_median (p10, p90, all), ctx/block/label
                   tokens_per_s, tflop_per_step + flops_mean_per_step (components, TFLOP) + flop_formulas, mfu
                   (vs 989 TFLOP/s; mfu_strict without fc's input gradient), peak_mem_gib_max/min (per-step
                   max_memory_allocated), recompiles_after_warmup (dynamo frames compiled during the timed
                   steps), warmup_s (compile included); baseline.ratio_vs_flex; mask_timing: mask_metadata
                   per row on the CPU, to_block_mask / create_block_mask per step on the GPU, block_masks_equal.
  precompute.json  forward (decoder only) / capture (hooks + top-k) / write_bf16 / write_fp8 (capture + copy +
                   ShardWriter, finalize included): tokens_per_s, ratio_vs_forward, bytes_per_token,
                   write_gb_per_s (store bytes / wall); two_gpus: tokens_per_s over both, scaling_vs_1gpu.
  loader.json      store (what was written), loader.workers_N: batches_per_s, ctx_tokens_per_s, gb_per_s (real
                   hidden bytes), startup_s; cold_cache: the same after dropping the page cache.
  train_scaling.json  gpus_1 / gpus_2 (`dflash train`, compile on): ctx_tokens_per_s_median over steps after
                   the first 5 (global, all processes), data_wait_frac_mean, peak_mem_gb, recompiles;
                   scaling_2_over_1.
  results.json     all of the above merged, plus comparisons (loader rate / train step rate).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PEAK_BF16_FLOPS = 989e12  # H100/H200 SXM dense bf16, the datasheet's number

# Qwen3-8B: the target, and the shape a 5-layer drafter copies from it.
QWEN3_8B = dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, intermediate_size=12288, vocab_size=151936, target_layer_ids=[1, 9, 17, 25, 33])
# Qwen3-32B: the 27B/32B-class shape (64 target layers; 5 evenly spaced in 1..61, docs/DESIGN.md §2).
QWEN3_32B = dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                 head_dim=128, intermediate_size=25600, vocab_size=151936, target_layer_ids=[1, 16, 31, 46, 61])
# Qwen3.6-27B (hybrid: 3 Gated DeltaNet layers per gated full-attention layer): the drafter copies its
# attention shape; bench/hybrid_27b.py adds the linear-attention fields for the target itself.
QWEN36_27B = dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4,
                  head_dim=256, intermediate_size=17408, vocab_size=248320, target_layer_ids=[1, 16, 31, 46, 61])
# SmolLM2-135M-Instruct (examples/smollm2): the real target of docs/RECIPE.md; a drafter of its width.
SMOLLM2_135M = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, intermediate_size=1536, vocab_size=49152, target_layer_ids=[1, 14, 27])
# Qwen2.5-Coder-0.5B-Instruct (examples/qwen2.5-coder-0.5b): the second real target; target layers as its params.
QWEN25_CODER_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                        head_dim=64, intermediate_size=4864, vocab_size=151936, target_layer_ids=[1, 11, 21])
SHAPES = {"smollm2-135m": SMOLLM2_135M, "qwen2.5-coder-0.5b": QWEN25_CODER_05B, "qwen3-8b": QWEN3_8B,
          "qwen3-32b": QWEN3_32B, "qwen3.6-27b": QWEN36_27B}
TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=128, vocab_size=1000, target_layer_ids=[1, 2])

T0 = time.time()


def tiny_mode(flag: bool = False) -> bool:
    return bool(flag) or os.environ.get("BENCH_TINY", "0") not in ("", "0")


def dims(tiny: bool, shape: str | None = None) -> dict:
    """The model shape: tiny, or `shape` (default $BENCH_SHAPE, else qwen3-8b)."""
    if tiny:
        return dict(TINY)
    shape = shape or os.environ.get("BENCH_SHAPE") or "qwen3-8b"
    if shape not in SHAPES:
        raise SystemExit(f"unknown shape {shape!r}; one of {', '.join(SHAPES)}")
    return dict(SHAPES[shape])


def out_dir() -> Path:
    p = Path(os.environ.get("OUT") or "/tmp/benchout")
    p.mkdir(parents=True, exist_ok=True)
    return p


def work_dir() -> Path:
    p = Path(os.environ.get("BENCH_WORK") or "/tmp/dflash_bench")
    p.mkdir(parents=True, exist_ok=True)
    return p


def part_limit_s(default: float) -> float:
    """Seconds this part may run (BENCH_PART_LIMIT_S, else the default)."""
    return float(os.environ.get("BENCH_PART_LIMIT_S") or default)


def elapsed() -> float:
    return time.time() - T0


def env_info() -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "host": platform.node(), "cuda": torch.cuda.is_available()}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001
        pass
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    info["work_fs"] = filesystem_of(work_dir())
    info["shm_fs"] = filesystem_of(Path("/dev/shm"))
    return info


def filesystem_of(path: Path) -> dict | None:
    """Mount point, type and free space of the filesystem holding `path` (is /tmp a disk or tmpfs?)."""
    try:
        path = path.resolve()
        best = None
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fstype = line.split()[:3]
            if (str(path) + "/").startswith(mnt.rstrip("/") + "/") and (best is None or len(mnt) > len(best[1])):
                best = (dev, mnt, fstype)
        st = os.statvfs(path)
        return {"mount": best[1], "type": best[2], "device": best[0], "free_gb": round(st.f_bavail * st.f_frsize / 1e9, 1),
                "size_gb": round(st.f_blocks * st.f_frsize / 1e9, 1)} if best else None
    except Exception:  # noqa: BLE001 - information only
        return None


class Results:
    """`$OUT/<name>.json`, rewritten after every `set` (atomic), each value also printed as one line."""

    def __init__(self, name: str, **meta):
        self.name = name
        self.path = out_dir() / f"{name}.json"
        self.data: dict = {"part": name, "env": env_info(), **meta}
        self.save()

    def save(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        os.replace(tmp, self.path)

    def set(self, key: str, value) -> None:
        self.data[key] = value
        self.save()
        print(f"[{self.name} +{elapsed():.0f}s] {key}: {json.dumps(value, default=str)}", flush=True)

    @contextlib.contextmanager
    def guard(self, key: str):
        """Run one measurement; an exception is recorded under `key` and the part goes on."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - a benchmark records every failure and continues
            traceback.print_exc()
            self.set(key, {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]})


def sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    if not n:
        return None
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def pctl(xs, q: float):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else None


def make_fake_target(path: Path, tiny: bool) -> tuple[Path, int]:
    """A target directory as training reads it: config.json of the target's shape, a chat-templated
    tokenizer (tests/helpers), and a model.safetensors holding only the embedding and the lm_head
    (random).  Returns (dir, the number of tokenizer ids); ids >= that are spare (the mask token)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import make_tokenizer  # noqa: E402

    d = dims(tiny)
    tok = make_tokenizer("qwen3")
    vocab = len(tok) + 8 if tiny else d["vocab_size"]
    cfg = transformers.Qwen3Config(
        hidden_size=d["hidden_size"], num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=d["num_attention_heads"], num_key_value_heads=d["num_key_value_heads"],
        head_dim=d["head_dim"], intermediate_size=d["intermediate_size"], vocab_size=vocab,
        max_position_embeddings=40960, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    path.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(path)
    tok.save_pretrained(path)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    tensors = {}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        w = torch.randn(vocab, d["hidden_size"], device=dev, generator=g).mul_(0.02).to(torch.bfloat16)
        tensors[name] = w.cpu()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path, len(tok)


# ------------------------------------------------------------------------------------------ summary

PARTS = ("train_step", "precompute", "loader", "train_scaling")


def _get(d, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _fmt(v, nd=1):
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        return f"{v:,.{nd}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def summarize() -> dict:
    out = out_dir()
    merged = {}
    for p in PARTS:
        f = out / f"{p}.json"
        if f.is_file():
            try:
                merged[p] = json.loads(f.read_text())
            except json.JSONDecodeError as e:
                merged[p] = {"error": f"unreadable: {e}"}
        else:
            merged[p] = {"error": "part did not run (time budget or crash before its first result)"}
    ts, pc, ld, sc = (merged[p] for p in PARTS)
    # cross-part comparisons
    train_ctx = _get(ts, "flex", "ctx_tokens_per_s")
    cmp = {}
    if train_ctx and isinstance(ld.get("loader"), dict):
        for w, r in ld["loader"].items():
            if isinstance(r, dict) and r.get("ctx_tokens_per_s"):
                cmp[f"loader_{w}_over_train_step"] = round(r["ctx_tokens_per_s"] / train_ctx, 3)
    merged["comparisons"] = cmp
    (out / "results.json").write_text(json.dumps(merged, indent=2, default=str))

    rows = [
        ("train step (flex, from_kv_blocks)", "ms/step", _get(ts, "flex", "step_ms_wall_mean")),
        ("  context tokens/s", "tok/s", _get(ts, "flex", "ctx_tokens_per_s")),
        ("  block tokens/s", "tok/s", _get(ts, "flex", "block_tokens_per_s")),
        ("  MFU (vs 989 TFLOP/s)", "", _get(ts, "flex", "mfu")),
        ("  peak memory max/min", "GiB", f"{_fmt(_get(ts, 'flex', 'peak_mem_gib_max'), 2)} / "
                                          f"{_fmt(_get(ts, 'flex', 'peak_mem_gib_min'), 2)}"),
        ("  recompiles after warm-up", "", _get(ts, "flex", "recompiles_after_warmup")),
        ("train step (create_block_mask each step)", "ms/step", _get(ts, "baseline_create_block_mask", "step_ms_wall_mean")),
        ("  baseline / flex step time", "x", _get(ts, "baseline_create_block_mask", "ratio_vs_flex")),
        ("mask_metadata per row (CPU)", "ms", _get(ts, "mask_timing", "mask_metadata_ms_per_row_median")),
        ("to_block_mask per step (GPU)", "ms", _get(ts, "mask_timing", "to_block_mask_ms_median")),
        ("create_block_mask per step (GPU)", "ms", _get(ts, "mask_timing", "create_block_mask_ms_median")),
        ("before (old loop: eager loss, syncs)", "ms/step", _get(ts, "flex_old", "step_ms_wall_mean")),
        ("  before MFU", "", _get(ts, "flex_old", "mfu")),
        ("+ fused loss only", "ms/step", _get(ts, "flex_fused_only", "step_ms_wall_mean")),
        ("2 rows / micro-batch", "ms/step", _get(ts, "rows2", "step_ms_wall_mean")),
        ("  2 rows MFU", "", _get(ts, "rows2", "mfu")),
        ("4 rows / micro-batch", "ms/step", _get(ts, "rows4", "step_ms_wall_mean")),
        ("  4 rows MFU", "", _get(ts, "rows4", "mfu")),
        ("8 rows / micro-batch", "ms/step", _get(ts, "rows8", "step_ms_wall_mean")),
        ("  8 rows MFU", "", _get(ts, "rows8", "mfu")),
        ("create_block_mask, loop with host syncs", "x", _get(ts, "baseline_create_block_mask_old_loop",
                                                               "ratio_vs_flex_old_loop")),
        ("precompute: forward only", "tok/s", _get(pc, "forward", "tokens_per_s")),
        ("precompute: hooks + top-k", "tok/s", _get(pc, "capture", "tokens_per_s")),
        ("precompute: + write bf16", "tok/s", _get(pc, "write_bf16", "tokens_per_s")),
        ("  ratio write_bf16 / forward (goal >= 0.9)", "", _get(pc, "write_bf16", "ratio_vs_forward")),
        ("  bytes/token bf16", "B", _get(pc, "write_bf16", "bytes_per_token")),
        ("  write GB/s bf16", "GB/s", _get(pc, "write_bf16", "write_gb_per_s")),
        ("precompute: + write fp8", "tok/s", _get(pc, "write_fp8", "tokens_per_s")),
        ("  bytes/token fp8", "B", _get(pc, "write_fp8", "bytes_per_token")),
        ("precompute: 2 GPUs total", "tok/s", _get(pc, "two_gpus", "tokens_per_s")),
        ("  scaling 2 GPUs / 1 GPU", "x", _get(pc, "two_gpus", "scaling_vs_1gpu")),
    ]
    for w, r in (ld.get("loader") or {}).items():
        if isinstance(r, dict):
            rows.append((f"loader {w}", "ctx tok/s", r.get("ctx_tokens_per_s")))
            rows.append(("  batches/s, GB/s", "", f"{_fmt(r.get('batches_per_s'), 2)}, {_fmt(r.get('gb_per_s'), 2)}"))
    for k, v in cmp.items():
        rows.append((f"  {k}", "x", v))
    for g in ("gpus_1", "gpus_2"):
        rows.append((f"dflash train {g}", "ctx tok/s", _get(sc, g, "ctx_tokens_per_s_median")))
        rows.append(("  data wait fraction", "", _get(sc, g, "data_wait_frac_mean")))
    rows.append(("  train scaling 2 GPUs / 1 GPU", "x", _get(sc, "scaling_2_over_1")))
    print("\n==================== dflash H200 benchmark summary ====================")
    for name, unit, v in rows:
        print(f"{name:<46} {_fmt(v, 3) if isinstance(v, float) and v < 10 else _fmt(v):>20} {unit}")
    errors = {p: merged[p]["error"] for p in PARTS if isinstance(merged[p], dict) and "error" in merged[p]}
    for p in PARTS:
        for k, v in (merged[p] or {}).items():
            if isinstance(v, dict) and "error" in v:
                errors[f"{p}.{k}"] = v["error"]
    for k, v in errors.items():
        print(f"ERROR {k}: {v}")
    print(f"results: {out / 'results.json'}")
    return merged


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "summarize":
        summarize()
    else:
        print("usage: python bench/common.py summarize", file=sys.stderr)
        sys.exit(2)
