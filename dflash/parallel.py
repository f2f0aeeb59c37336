"""Data parallelism for the drafter: DDP (the default) or FSDP2, and the dtype gradients travel in.

Gradients are kept and applied in fp32.  `grad_reduce_dtype="bf16"` sends them over the wire in bf16:
half the all-reduce bytes (4.2 GB -> 2.1 GB a step for a 1B-parameter drafter), at bf16's 8-bit
mantissa for each rank's share of the average.  Off by default: it changes the numbers, not the
semantics, and pays only where the all-reduce competes with the backward for the GPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

REDUCE_DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def low_precision_reduce_hook(dtype: torch.dtype):
    """A DDP comm hook: each bucket divided by the world size, cast to `dtype`, all-reduced (sum), and
    copied back into the fp32 bucket.  torch's own bf16_compress_hook does the same but is refused on
    CPU process groups; this one runs on gloo too, so the tests exercise the very path GPUs take."""

    # no annotations: DDP checks them against dist.GradBucket, and this module's are strings (__future__)
    def hook(group, bucket):
        group = group if group is not None else dist.group.WORLD
        buf = bucket.buffer()
        low = buf.to(dtype).div_(dist.get_world_size(group))
        fut = dist.all_reduce(low, group=group, async_op=True).get_future()

        def back(f):
            buf.copy_(f.value()[0])
            return buf

        return fut.then(back)

    hook.__name__ = f"{dtype}_reduce_hook".replace("torch.", "")
    return hook


def wrap(raw: torch.nn.Module, parallel: str, grad_reduce_dtype: str, device: torch.device, world: int):
    """The DDP wrapper (or None), with FSDP2 applied in place to `raw` when parallel == "fsdp"."""
    if world <= 1:
        return None
    low = REDUCE_DTYPES[grad_reduce_dtype]
    if parallel == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # One FSDP group for the whole drafter: each layer's context K/V projection is called from the
        # drafter's forward (outside the layer's own forward), so per-layer groups would not be gathered
        # in time. Drafters are a few layers; one all-gather per step is cheap.
        fully_shard(raw, mp_policy=MixedPrecisionPolicy(reduce_dtype=low))
        return None
    from torch.nn.parallel import DistributedDataParallel as DDP

    # 256 MB buckets: a few per layer, so the all-reduce overlaps the backward in ~20 pieces
    # (DDP's 25 MB default would cut the compiled backward into one graph per weight matrix).
    # broadcast_buffers=False: the only buffer is RoPE's inv_freq, a function of the config; DDP's
    # default would broadcast it from rank 0 at every forward (a collective in front of each step).
    ddp = DDP(raw, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=256,
              gradient_as_bucket_view=True, broadcast_buffers=False)
    if low is not None:
        ddp.register_comm_hook(None, low_precision_reduce_hook(low))
    return ddp


__all__ = ["REDUCE_DTYPES", "low_precision_reduce_hook", "wrap"]
