"""The target this project exists for, at its real width on one GPU: a Qwen3.6-27B-shaped hybrid target
(Gated DeltaNet + gated attention, 3:1) captured with and without flash-linear-attention, and a drafter
training step at its hidden size (5120) with all-full layers against the published layout (four sliding
layers, window 2048, then one full layer).

    python bench/hybrid_27b.py --part capture [--fla-path DIR] [--tokens 65536] [--tiny]
    python bench/hybrid_27b.py --part step [--tiny]

`--part capture` runs itself twice in subprocesses, once with DIR (where the fla wheels are installed)
on sys.path and once without, so transformers picks its kernels or its torch fallback; each builds the
random-init target straight on the GPU in bf16 (`Qwen3_5ForCausalLM`, no checkpoint) and times the
decoder's forward alone and `dflash.target_model.capture.Capture` (hooks at 5 layers + top-k) over the same
right-padded batches (`--token-budget` tokens each).  `--part step` times `bench/train_step.py`'s
TrainStep (the trainer's step) on one 8192-token sample per row, for each layer layout and anchor count.
Results: $OUT/hybrid_capture.json, $OUT/hybrid_step.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

import common  # noqa: F401  (puts the repo root on sys.path)
from common import Results, dims, out_dir, sync

# Qwen3.6-27B's text config (the linear-attention fields; the rest is common.QWEN36_27B)
LINEAR = dict(linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
              linear_value_head_dim=128, linear_conv_kernel_dim=4)
TINY_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                   linear_value_head_dim=16, linear_conv_kernel_dim=4)


def build_hybrid(tiny: bool, device: str):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    d = dims(tiny, "qwen3.6-27b")
    n = d["num_hidden_layers"]
    cfg = Qwen3_5TextConfig(
        hidden_size=d["hidden_size"], num_hidden_layers=n, num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=d["num_key_value_heads"], head_dim=d["head_dim"],
        intermediate_size=d["intermediate_size"], vocab_size=d["vocab_size"], tie_word_embeddings=False,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)],
        **(TINY_LINEAR if tiny else LINEAR))
    cfg._attn_implementation = "sdpa"
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3_5ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    return model.eval().requires_grad_(False), d


def capture_one(args) -> dict:
    """In this process: the target, then forward-only and capture rates over the same batches."""
    import importlib.util

    from dflash.target_model.capture import Capture, linear_attention_note

    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    t = time.perf_counter()
    model, d = build_hybrid(args.tiny, device)
    build_s = time.perf_counter() - t
    n_params = sum(p.numel() for p in model.parameters())
    capture = Capture(model, d["target_layer_ids"], topk=8, lm_head_chunk=4096)
    g = torch.Generator().manual_seed(0)
    seq = 256 if args.tiny else 4096
    rows = max(1, args.token_budget // seq)
    batches = [torch.randint(0, d["vocab_size"] - 1, (rows, seq), generator=g)
               for _ in range(max(1, args.tokens // (rows * seq)))]
    lengths = torch.full((rows,), seq)

    def rate(fn) -> tuple[float, float]:
        fn(batches[0])  # warm-up: kernels, autotuning, allocator
        sync(device)
        t0 = time.perf_counter()
        for b in batches:
            fn(b)
        sync(device)
        dt = time.perf_counter() - t0
        return sum(b.numel() for b in batches) / dt, dt

    with torch.inference_mode():
        fwd, fwd_s = rate(lambda b: capture.decoder(input_ids=b.to(device), use_cache=False))
    cap, cap_s = rate(lambda b: capture(b.to(device), lengths))
    return {"fla_importable": importlib.util.find_spec("fla") is not None, "fla_loaded_after_forward": sorted({k.split(".")[0] for k in sys.modules if k.split(".")[0] in ("fla", "causal_conv1d")}),
            "start_up_line": linear_attention_note(model), "params_b": round(n_params / 1e9, 2),
            "build_s": round(build_s, 1), "tokens": sum(b.numel() for b in batches), "batch": [rows, seq],
            "forward_tokens_per_s": round(fwd), "capture_tokens_per_s": round(cap),
            "capture_vs_forward": round(cap / fwd, 3), "forward_s": round(fwd_s, 1), "capture_s": round(cap_s, 1),
            "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if device != "cpu" else None}


def capture_part(args) -> None:
    res = Results("hybrid_capture", tiny=args.tiny, device="cuda" if torch.cuda.is_available() else "cpu")
    base = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    modes = {"without_fla": base}
    if args.fla_path:
        modes = {"with_fla": [args.fla_path] + base, **modes}
    for name, path in modes.items():
        cmd = [sys.executable, __file__, "--part", "capture_one", "--tokens", str(args.tokens),
               "--token-budget", str(args.token_budget)] + (["--tiny"] if args.tiny else [])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        with res.guard(name):
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            if p.returncode:
                raise RuntimeError(p.stderr[-3000:])
            res.set(name, json.loads(p.stdout.strip().splitlines()[-1]))
    w, wo = res.data.get("with_fla"), res.data.get("without_fla")
    if isinstance(w, dict) and isinstance(wo, dict) and "capture_tokens_per_s" in w and "capture_tokens_per_s" in wo:
        res.set("capture_speedup_with_fla", round(w["capture_tokens_per_s"] / wo["capture_tokens_per_s"], 2))


def step_part(args) -> None:
    import train_step as TS

    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    res = Results("hybrid_step", tiny=args.tiny, device=device)
    S = 512 if args.tiny else 8192
    window = 128 if args.tiny else 2048
    n_layers = 2 if args.tiny else 5
    layouts = {"full": None, "sliding4_full1": ["sliding"] * (n_layers - 1) + ["full"]}
    for name, types in layouts.items():
        bargs = argparse.Namespace(layers=n_layers, block_size=16, lm_head_chunk=2048,
                                   compile="auto", steps=3 if args.tiny else 10, warmup=1 if args.tiny else 2,
                                   batches=2 if args.tiny else 3, profile=False,
                                   layer_types=types,
                                   sliding_window=window if types else None)
        with res.guard(name):
            bench = TS.Bench(bargs, args.tiny, device, "qwen3.6-27b")
            for anchors in (64, 256):
                Q = anchors * 16
                TS.run_config(res, bench, f"{name}_anchors{anchors}", 1, S, Q, 1, bargs, baseline=False)
            del bench
            if device != "cpu":
                torch.cuda.empty_cache()
    for anchors in (64, 256):
        f, s = res.data.get(f"full_anchors{anchors}"), res.data.get(f"sliding4_full1_anchors{anchors}")
        if isinstance(f, dict) and isinstance(s, dict) and "step_ms_wall_mean" in f and "step_ms_wall_mean" in s:
            res.set(f"sliding_speedup_anchors{anchors}", round(f["step_ms_wall_mean"] / s["step_ms_wall_mean"], 3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", required=True, choices=["capture", "capture_one", "step"])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--fla-path", default=None, help="directory holding flash-linear-attention (capture)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per timed pass (capture)")
    ap.add_argument("--token-budget", type=int, default=None, help="tokens per forward batch (capture)")
    ap.add_argument("--timeout", type=float, default=400)
    args = ap.parse_args()
    args.tokens = args.tokens or (1024 if args.tiny else 65536)
    args.token_budget = args.token_budget or (512 if args.tiny else 8192)
    if args.part == "capture_one":
        print(json.dumps(capture_one(args)))
        return
    if args.part == "capture":
        capture_part(args)
    else:
        step_part(args)
    print(f"results in {out_dir()}")


if __name__ == "__main__":
    main()
