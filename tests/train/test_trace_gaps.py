"""bench/trace_gaps.py: GPU idle time and the host's blocking calls, from a synthetic Chrome trace."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import trace_gaps  # noqa: E402


def _ev(cat, name, ts, dur, pid=0, tid=7):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid}


def test_busy_time_is_the_union_over_streams_and_gaps_name_the_host_calls(tmp_path):
    events = [
        _ev("kernel", "gemm", 0, 100, tid=7),
        _ev("kernel", "other_stream", 50, 100, tid=8),  # overlaps: busy 0..150
        _ev("gpu_memcpy", "Memcpy DtoH", 150, 50),  # touching: busy 0..200
        _ev("kernel", "after_sync", 1200, 300),  # a 1000 us gap before it
        _ev("kernel", "short_gap", 1550, 50),  # a 50 us gap: under the 100 us minimum
        _ev("cuda_runtime", "cudaStreamSynchronize", 100, 300, pid=1234, tid=1),
        _ev("cpu_op", "aten::to", 90, 320, pid=1234, tid=1),
        _ev("cuda_runtime", "cudaLaunchKernel", 1150, 10, pid=1234, tid=1),
        _ev("cuda_runtime", "cudaMemcpyAsync", 10, 5, pid=1234, tid=1),  # not blocking
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events + [{"ph": "i", "name": "marker", "ts": 3}]}))
    out = trace_gaps.summarize_file(path)
    dev = out["devices"]["0"]
    assert dev["window_ms"] == 1.6
    assert dev["busy_ms"] == 0.55  # 200 + 300 + 50 us
    assert dev["gaps_over_min"] == 1
    gap = dev["longest_gaps"][0]
    assert gap["idle_ms"] == 1.0 and gap["at_ms"] == 0.2
    assert set(gap["host_during"]) == {"cudaStreamSynchronize", "aten::to", "cudaLaunchKernel"}
    assert gap["host_during"]["cudaStreamSynchronize"] == 0.2  # 200..400 of the gap 200..1200
    assert out["host_blocking_calls"] == {"cudaStreamSynchronize": {"count": 1, "total_ms": 0.3}}


def test_a_trace_without_gpu_events_says_so():
    out = trace_gaps.summarize([_ev("cpu_op", "aten::mm", 0, 10)])
    assert "no GPU events" in out["error"]
