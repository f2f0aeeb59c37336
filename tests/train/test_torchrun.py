"""The multi-node spelling from the README: both stages under plain `torchrun` (here 2 CPU ranks, gloo).

Under torchrun nothing is spawned: each global rank is one shard in precompute and one data-parallel rank
in training.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.compute as pc
import pytest

from dflash.store import open_store, verify_store
from helpers import make_conversations_jsonl

ROOT = Path(__file__).resolve().parents[2]


def _torchrun(*args, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "dflash.cli", *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_both_stages_under_torchrun(tmp_path, tiny_target):
    data = make_conversations_jsonl(tmp_path / "d.jsonl", 12)
    store, run = tmp_path / "store", tmp_path / "run"
    p = _torchrun("precompute", "--target", tiny_target, "--data", data, "--out", store, "--gpus", "cpu",
                  "--target-layers", "1,2", "--max-length", "128", "--topk", "4", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    s = open_store(store)
    assert s.manifest["num_shards"] == 2 and len(s) == 12
    shard1 = s.index.filter(pc.equal(s.index["shard"], 1))["sample_id"].to_pylist()
    assert shard1 and all(i % 2 == 1 for i in shard1)  # row i belongs to shard i % world size
    assert verify_store(store).ok

    p = _torchrun("train", "--store", store, "--target", tiny_target, "--out", run, "--gpus", "cpu:2",
                  "--steps", "2", "--block-size", "4", "--num-layers", "1", "--token-budget", "256",
                  "--num-anchors", "4", "--num-workers", "1", "--compile", "off", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads((run / "metrics.json").read_text())["steps"] == 2
    assert json.loads((run / "config.json").read_text())["world_size"] == 2
