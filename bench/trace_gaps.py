"""Where a GPU sat idle in a torch.profiler Chrome trace, and what the host was doing meanwhile.

    python bench/trace_gaps.py RUN/profile/rank0.trace.json [--top 12] [--min-gap-us 100]

The kernel tables of `dflash train --profile-steps` and `precompute_bench.py --passes write_profile` say
what the GPU ran; they cannot say when it ran nothing.  This reads the trace itself: the union of every
kernel, memcpy and memset interval per device (all streams) is the busy time; everything between is idle.
For each of the longest idle gaps it names the host-side CUDA runtime calls and operators in progress
(`cudaStreamSynchronize` there means the host waited for the GPU, and then the GPU waited for the host),
and it counts the host's blocking calls over the whole window.  Output: one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATS = {"cuda_runtime", "cuda_driver", "cpu_op", "user_annotation", "python_function"}
# host calls that block until the device has caught up (or a copy has finished)
BLOCKING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
            "cudaStreamQuery")


def load(path) -> list[dict]:
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _is_blocking(name: str) -> bool:
    # cudaMemcpy without Async is synchronous; cudaMemcpyAsync is not
    return any(name == b or (name.startswith(b) and b != "cudaMemcpy") for b in BLOCKING)


def summarize(events: list[dict], top: int = 12, min_gap_us: float = 100.0) -> dict:
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    host = [e for e in events if e.get("cat") in HOST_CATS]
    if not gpu:
        return {"error": "no GPU events in this trace (a CPU run, or the profiler had no CUDA activity)"}
    devices = sorted({e.get("pid") for e in gpu}, key=str)
    out = {"devices": {}}
    for dev in devices:
        busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in gpu if e.get("pid") == dev])
        t0, t1 = busy[0][0], busy[-1][1]
        busy_us = sum(b - a for a, b in busy)
        gaps = [(b0[1], b1[0]) for b0, b1 in zip(busy, busy[1:]) if b1[0] - b0[1] >= min_gap_us]
        gaps.sort(key=lambda g: g[0] - g[1])
        listed = []
        for a, b in gaps[:top]:
            during = {}
            for e in host:
                lo, hi = max(a, e["ts"]), min(b, e["ts"] + e["dur"])
                if hi > lo:
                    during[e["name"]] = during.get(e["name"], 0.0) + (hi - lo)
            names = sorted(during.items(), key=lambda kv: -kv[1])[:5]
            listed.append({"at_ms": round((a - t0) / 1e3, 2), "idle_ms": round((b - a) / 1e3, 3),
                           "host_during": {n[:80]: round(us / 1e3, 3) for n, us in names}})
        out["devices"][str(dev)] = {
            "window_ms": round((t1 - t0) / 1e3, 2),
            "busy_ms": round(busy_us / 1e3, 2),
            "busy_frac": round(busy_us / max(t1 - t0, 1e-9), 4),
            "idle_ms_in_gaps_over_min": round(sum(b - a for a, b in gaps) / 1e3, 2),
            "gaps_over_min": len(gaps),
            "longest_gaps": listed,
        }
    blocking: dict[str, list[float]] = {}
    for e in host:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and _is_blocking(e["name"]):
            c = blocking.setdefault(e["name"], [0, 0.0])
            c[0] += 1
            c[1] += e["dur"]
    out["host_blocking_calls"] = {n: {"count": c, "total_ms": round(us / 1e3, 2)} for n, (c, us) in
                                  sorted(blocking.items(), key=lambda kv: -kv[1][1])}
    out["min_gap_us"] = min_gap_us
    return out


def summarize_file(path, top: int = 12, min_gap_us: float = 100.0) -> dict:
    return summarize(load(path), top, min_gap_us)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--min-gap-us", type=float, default=100.0)
    a = ap.parse_args()
    print(json.dumps(summarize_file(a.trace, a.top, a.min_gap_us), indent=1))


if __name__ == "__main__":
    main()
