"""precompute's disk-space check: a new store that cannot fit stops before anything is written, and its
estimate is what the store then holds."""

from __future__ import annotations

import json
from collections import namedtuple

import pytest

from dflash.config import PrecomputeConfig
from dflash.precompute import space
from dflash.precompute.run import run_precompute
from dflash.store import open_store
from dflash.store.manifest import MANIFEST
from helpers import make_conversations, make_tiny_target
from processes import invoke

Usage = namedtuple("Usage", "total used free")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("target"), arch="qwen3")


@pytest.fixture
def data(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in make_conversations(24, seed=4, min_words=10, max_words=30)))
    return p


def _args(target, data, out):
    return ["--target", target, "--data", data, "--out", out, "--gpus", "cpu", "--max-length", 512,
            "--target-layers", "0,2", "--topk", 0]


def test_the_estimate_counts_the_tokens_the_store_then_holds(target, data, tmp_path, monkeypatch):
    seen = []
    real = space.space_problem
    monkeypatch.setattr(space, "space_problem", lambda *a: seen.append(a) or real(*a))
    tot = run_precompute(PrecomputeConfig(target=str(target), data=str(data), out=str(tmp_path / "s"), gpus="cpu",
                                          max_length=512, target_layers=[0, 2], topk=0))
    [(_, rows, mean, per_token)] = seen
    assert rows == tot["num_samples"] == 24  # fewer rows than the sample: every row is rendered, exactly
    assert rows * mean == tot["num_tokens"]
    assert per_token == open_store(tmp_path / "s").hidden_size * 2 * 2  # two layers, bf16
    stored = sum(f.stat().st_size for f in (tmp_path / "s").rglob("*") if f.is_file())
    assert stored >= 0.9 * rows * mean * per_token  # the features are most of the store: a floor
    run_precompute(PrecomputeConfig(target=str(target), data=str(data), out=str(tmp_path / "s"), gpus="cpu",
                                    max_length=512, target_layers=[0, 2], topk=0))
    assert len(seen) == 1  # a store that exists (resumed, here complete) is not estimated again


def test_a_store_that_cannot_fit_stops_before_anything_is_written(target, data, tmp_path, monkeypatch):
    monkeypatch.setattr(space.shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 50_000, 50_000))
    out = tmp_path / "s"
    code, _, err = invoke(_args(target, data, out))
    assert code == 1 and "Traceback" not in err
    assert f"store {out} would not fit" in err and "0.0 GB is free" in err and "--no-space-check" in err, err
    assert "24 conversations" in err, err
    assert not (out / MANIFEST).exists() and not list(out.rglob("*.arrow")) and not (out / "parts").exists()
    code, _, err = invoke([*_args(target, data, out), "--no-space-check"])
    assert code == 0, err
    assert len(open_store(out).sample_ids()) == 24


def test_the_check_leaves_the_stores_bytes_alone(target, data, tmp_path):
    """Whether the space was checked is the run's, not the store's: the same store either way."""
    from helpers import differing_files

    for check, name in ((True, "a"), (False, "b")):
        run_precompute(PrecomputeConfig(target=str(target), data=str(data), out=str(tmp_path / name), gpus="cpu",
                                        max_length=512, target_layers=[0, 2], topk=0, space_check=check))
    assert "space_check" not in open_store(tmp_path / "a").manifest["precompute_config"]
    assert differing_files(tmp_path / "a", tmp_path / "b") == []
