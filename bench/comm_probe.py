"""How fast the GPUs of this host exchange a drafter's gradients: NCCL all-reduce of one step's gradients
(1.05 B fp32 values for the Qwen3-8B-shaped 5-layer drafter = 4.2 GB, and the same in bf16) between two
processes, one per GPU, plus `nvidia-smi topo -m` (NVLink or PCIe between the GPUs?).

    python bench/comm_probe.py [--numel 1048626432] [--reps 5]

Why: DDP all-reduces every gradient once per optimizer step; what of it the backward cannot hide is the
2-GPU step's overhead over the 1-GPU step, so this bounds training's scaling on this host.
Results: $OUT/comm.json (algbw = bytes / time, the rate one process sees).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import common  # noqa: F401  (puts the repo root on sys.path)
from common import Results


def _worker(rank: int, world: int, numel: int, reps: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.ones(numel, dtype=dtype, device="cuda")
        dist.all_reduce(x)  # warm-up: communicator, buffers
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            dist.barrier()
            torch.cuda.synchronize()
            t = time.perf_counter()
            dist.all_reduce(x)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        best = min(times)
        out[str(dtype).replace("torch.", "")] = {"bytes": x.numel() * x.element_size(), "ms_best": round(best * 1e3, 2),
                                                  "ms_all": [round(t * 1e3, 2) for t in times],
                                                  "algbw_gb_per_s": round(x.numel() * x.element_size() / best / 1e9, 1)}
        del x
        torch.cuda.empty_cache()
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=1048626432, help="values per all-reduce (default: the 8B-shaped drafter)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    res = Results("comm", numel=args.numel)
    try:
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        topo = f"unavailable: {e}"
    res.set("topology", topo.splitlines())
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        res.set("all_reduce", {"skipped": f"{n} GPU(s) visible"})
        return
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, 2, args.numel, args.reps, 29533, queue)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    res.set("all_reduce", queue.get() if not queue.empty() else {"error": [p.exitcode for p in procs]})


if __name__ == "__main__":
    main()
