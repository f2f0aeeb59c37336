"""bench/host_profile.py: per-step tables and the host-sync calls (with their callers) from a real cProfile."""

import cProfile
import sys
from pathlib import Path

import torch

from dflash.drafter.labels import IGNORE, previous_tokens

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


def _previous_tokens_masked(labels, block_input_ids, block_size):
    """previous_tokens as a boolean-mask assignment (a nonzero(), so a host sync, on a GPU)."""
    prev = torch.full_like(labels, IGNORE)
    k = torch.arange(1, labels.shape[1]) % block_size
    prev[:, 1:] = torch.where(k == 1, block_input_ids[:, :-1], labels[:, :-1])
    prev[:, 1:][:, k == 0] = IGNORE
    return prev


def test_sync_scan_names_the_ops_that_wait_for_a_gpu_and_previous_tokens_has_none():
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 50, (3, 32), generator=g)
    labels[labels < 10] = IGNORE
    ids = torch.randint(0, 50, (3, 32), generator=g)
    with host_profile.SyncScan() as scan:
        masked = _previous_tokens_masked(labels, ids, 4)
        float(masked.sum())
    ops = {op for op, _ in scan.found}
    assert "index_put_ [bool mask]" in ops and "_local_scalar_dense" in ops
    assert all(where.endswith("test_host_profile.py") or where == "outside dflash" for _, where in scan.found)
    with host_profile.SyncScan() as scan:
        prev = previous_tokens(labels, ids, 4)
    assert not scan.found
    assert torch.equal(prev, masked)
    for B in (1, 2, 16):
        assert torch.equal(previous_tokens(labels, ids, B), _previous_tokens_masked(labels, ids, B))
