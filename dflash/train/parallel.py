"""Data parallelism for the drafter: DDP (the default) or FSDP2, applied before compilation.

Gradients are all-reduced in fp32.  A bf16 all-reduce (a DDP comm hook: half the bytes) was tried and
dropped: the fp32 all-reduce already overlaps the backward, so there was little to save, and the casts
and bf16 copies cost more time and memory than the bytes saved (benchmarks/train-two-gpus-h200-2026-11-30.md).
"""

from __future__ import annotations

import torch


def wrap(raw: torch.nn.Module, parallel: str, device: torch.device, world: int):
    """The DDP wrapper (or None), with FSDP2 applied in place to `raw` when parallel == "fsdp"."""
    if world <= 1:
        return None
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        # One FSDP group for the whole drafter: each layer's context K/V projection is called from the
        # drafter's forward (outside the layer's own forward), so per-layer groups would not be gathered
        # in time. Drafters are a few layers; one all-gather per step is cheap.
        fully_shard(raw)
        return None
    from torch.nn.parallel import DistributedDataParallel as DDP

    # 256 MB buckets: a few per layer, so the all-reduce overlaps the backward in ~20 pieces
    # (DDP's 25 MB default would cut the compiled backward into one graph per weight matrix).
    # broadcast_buffers=False: the buffers are RoPE's inv_freq, a function of the config, and with
    # --context-scale rms the context scale, the same on every rank (preflight's or the checkpoint's);
    # DDP's default would broadcast them from rank 0 at every forward (a collective in front of each step).
    return DDP(raw, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=256,
               gradient_as_bucket_view=True, broadcast_buffers=False)


__all__ = ["wrap"]
