"""Rendering in worker processes (dflash/precompute/render_pool.py) gives the store that inline rendering gives,
and a row that cannot be rendered still stops the run with its row named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash.config import PrecomputeConfig
from dflash.errors import DFlashError
from dflash.precompute.run import run_precompute
from dflash.store import open_store
from dflash.store.manifest import shard_status
from dflash.store.runinfo import read_runs
from helpers import differing_files, make_conversations_jsonl


def _cfg(target, data, out, **kw) -> PrecomputeConfig:
    # a small window and budget, so that several windows and batches are in flight at once
    opts = dict(target=str(target), data=str(data), out=str(out), gpus="cpu", max_length=256, topk=3,
                target_layers=[1, 2], token_budget=300)
    opts.update(kw)
    return PrecomputeConfig(**opts)


def _samples(root: Path) -> dict:
    s = open_store(root)
    return {sid: {k: v.tolist() for k, v in s.read(sid).items()} for sid in s.sample_ids()}


def test_workers_write_the_store_inline_rendering_writes(tmp_path, tiny_target, monkeypatch):
    import dflash.precompute.shard as shard

    monkeypatch.setattr(shard, "WINDOW", 5)  # 23 rows: five windows, three of them rendered ahead
    data = make_conversations_jsonl(tmp_path / "d.jsonl", 23, seed=5)
    run_precompute(_cfg(tiny_target, data, tmp_path / "inline", render_workers=0))
    run_precompute(_cfg(tiny_target, data, tmp_path / "pool", render_workers=2))
    want, got = _samples(tmp_path / "inline"), _samples(tmp_path / "pool")
    assert len(want) == 23
    assert sorted(got) == sorted(want)
    assert [sid for sid in want if got[sid] != want[sid]] == []
    assert shard_status(tmp_path / "pool", 0)["render_workers"] == 2
    # a store is a function of its inputs: the workers change how it is made, not one byte of it; how it
    # was made is recorded beside it
    assert differing_files(tmp_path / "inline", tmp_path / "pool") == []
    status = json.loads((tmp_path / "pool" / "shard-00000" / "status.json").read_text())
    assert status == {"status": "complete", "num_samples": 23, "num_tokens": status["num_tokens"],
                      "num_supervised": status["num_supervised"], "rows": 23, "skipped": 0, "cut_away": 0,
                      "truncated": status["truncated"]}
    (run,) = read_runs(tmp_path / "pool")
    assert run["options"]["render_workers"] == 2 and run["num_samples"] == 23 and run["wall_s"] > 0


def test_a_row_a_worker_cannot_render_names_the_row(tmp_path, tiny_target):
    from dflash.chat import load_rows
    from dflash.precompute.render_pool import RenderPool
    from dflash.target_model.capture import load_tokenizer

    data = make_conversations_jsonl(tmp_path / "d.jsonl", 6, seed=1)
    with open(data, "a") as f:  # row 6: a format no reader knows (the row checks would stop it first)
        f.write(json.dumps({"text": "no conversation here"}) + "\n")
    cfg = _cfg(tiny_target, data, tmp_path / "s", render_workers=1)
    tok, ds = load_tokenizer(cfg.target), load_rows(cfg.data, check=False)
    with RenderPool(cfg, tok, ds, 1, window=4) as pool:
        got = [r for w in pool.windows([0, 1, 2, 3, 4, 5]) for r, _ in w]
    assert got == [0, 1, 2, 3, 4, 5]
    with RenderPool(cfg, tok, ds, 1, window=4) as pool, pytest.raises(DFlashError, match="row 6: unknown conversation format"):
        list(pool.windows([0, 6]))
