"""How long `weights_fingerprint` takes on a checkpoint with Qwen3-8B's 399 tensor names and shapes (bf16,
uninitialised values, 16.4 GB in 4 files): once after dropping the page cache (needs root), once warm.

    python bench/fingerprint_time.py [--dir /tmp/fp8b]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash.target_model.files import weights_fingerprint  # noqa: E402

HIDDEN, INTER, VOCAB, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 4096, 12288, 151936, 36, 32, 8, 128


def qwen3_8b_shapes() -> dict[str, tuple[int, ...]]:
    h = HIDDEN
    shapes = {"model.embed_tokens.weight": (VOCAB, h), "lm_head.weight": (VOCAB, h), "model.norm.weight": (h,)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, h), p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, h),
            p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, h), p + "self_attn.o_proj.weight": (h, HEADS * HEAD_DIM),
            p + "self_attn.q_norm.weight": (HEAD_DIM,), p + "self_attn.k_norm.weight": (HEAD_DIM,),
            p + "mlp.gate_proj.weight": (INTER, h), p + "mlp.up_proj.weight": (INTER, h),
            p + "mlp.down_proj.weight": (h, INTER),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
    return shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/fp8b")
    out = Path(ap.parse_args().dir)
    out.mkdir(parents=True, exist_ok=True)
    shapes = qwen3_8b_shapes()
    names = sorted(shapes)
    per = (len(names) + 3) // 4
    if not list(out.glob("*.safetensors")):
        for j in range(4):
            tensors = {n: torch.empty(shapes[n], dtype=torch.bfloat16) for n in names[j * per : (j + 1) * per]}
            save_file(tensors, str(out / f"model-{j:05d}-of-00004.safetensors"))
    dropped = os.system("sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null") == 0
    for label in ("cold" if dropped else "first", "warm"):
        t = time.perf_counter()
        weights_fingerprint(out)
        print(f"{label}: {time.perf_counter() - t:.3f} s")
    size = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 1e9
    print(f"{len(names)} tensors, {size:.1f} GB")


if __name__ == "__main__":
    main()
