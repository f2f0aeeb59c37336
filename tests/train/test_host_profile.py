"""bench/host_profile.py: per-step tables and the host-sync calls (with their callers) from a real cProfile."""

import cProfile
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import host_profile  # noqa: E402


def _step(x: torch.Tensor) -> float:
    y = (x * 2).sum()
    return sum(y.reshape(1).tolist()) + float(x.nonzero().shape[0]) + x.mean().item()


def test_tables_name_each_sync_with_its_caller_per_step():
    x = torch.arange(8.0)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(4):
        _step(x)
    prof.disable()
    top, syncs, text = host_profile._tables(prof, steps=4, top=30)
    by_call = {s["call"]: s for s in syncs}
    assert set(by_call) >= {"tolist", "item", "nonzero"}
    for call in ("tolist", "item", "nonzero"):
        assert by_call[call]["per_step"] == 1.0
        assert "test_host_profile.py" in by_call[call]["caller"] and "(_step)" in by_call[call]["caller"]
    step = next(r for r in top if r["function"].endswith("(_step)"))
    assert step["calls_per_step"] == 1.0 and step["cum_ms_per_step"] >= step["self_ms_per_step"] >= 0
    assert "_step" in text
