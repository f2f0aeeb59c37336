"""The store's final_hidden array at the writer's level: round trips (bf16 exact, fp8 within e4m3), and a
writer stopped after a commit then reopened writes the bytes an uninterrupted one writes, final_hidden
included (its rows go through the tail file like every array's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash.store import ShardWriter, create_or_check_manifest, open_store, verify_store

H, L, K = 32, 2, 4
SMALL = dict(commit_every_tokens=40, chunk_tokens=8, chunks_per_object=4, flush_tokens=32, durable=False)


def _manifest(hidden_dtype: str) -> dict:
    return {"target": {"path": "/t", "config_hash": "abc", "hidden_size": H, "num_hidden_layers": 4, "vocab_size": 1000},
            "tokenizer_hash": "tok", "dataset_fingerprint": "d", "target_layer_ids": [1, 2],
            "hidden_dtype": hidden_dtype, "topk": K, "max_length": 64, "num_shards": 1, "final_hidden": True}


def _sample(sid: int) -> dict:
    g = torch.Generator().manual_seed(sid)
    t = 3 + (sid * 7) % 17
    return {"input_ids": torch.randint(0, 1000, (t,), generator=g),
            "loss_mask": (torch.rand(t, generator=g) > 0.3).to(torch.uint8),
            "hidden": torch.randn(t, H * L, generator=g),
            "topk_ids": torch.randint(0, 1000, (t, K), generator=g),
            "topk_logprobs": -torch.rand(t, K, generator=g),
            "final_hidden": torch.randn(t, H, generator=g) * torch.linspace(0.01, 20, H)}


def _writer(root: Path, hidden_dtype: str) -> ShardWriter:
    return ShardWriter(root, 0, hidden_width=H * L, num_layers=L, hidden_dtype=hidden_dtype, topk=K,
                       final_hidden=True, **SMALL)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted((root / "shard-00000").rglob("*"))
            if p.is_file()}


@pytest.mark.parametrize("hidden_dtype", ["bf16", "fp8"])
def test_stopped_after_a_commit_then_reopened_writes_the_same_bytes(tmp_path, hidden_dtype):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    for root in (whole, resumed):
        create_or_check_manifest(root, _manifest(hidden_dtype))
    with _writer(whole, hidden_dtype) as w:
        for sid in range(20):
            w.append(sid, sid, **_sample(sid))
        w.finalize()
    w = _writer(resumed, hidden_dtype)
    for sid in range(9):
        w.append(sid, sid, **_sample(sid))
    w.commit()
    w.append(9, 9, **_sample(9))  # appended, never committed: gone, as after kill -9
    w.abort()
    with _writer(resumed, hidden_dtype) as w:
        assert w.committed_sample_ids() == set(range(9))
        for sid in range(9, 20):
            w.append(sid, sid, **_sample(sid))
        w.finalize()
    assert _files(resumed) == _files(whole) and verify_store(resumed).ok
    s = open_store(resumed)
    for sid in s.sample_ids():
        got, want = s.read(sid)["final_hidden"].float(), _sample(sid)["final_hidden"]
        if hidden_dtype == "bf16":
            assert torch.equal(got, want.bfloat16().float())
        else:  # 3 mantissa bits, scaled per token
            amax = want.abs().amax(-1, keepdim=True)
            assert ((got - want).abs() <= want.abs() / 16 + amax / 448).all()


def test_a_writer_of_final_hidden_needs_it(tmp_path):
    create_or_check_manifest(tmp_path, _manifest("bf16"))
    with _writer(tmp_path, "bf16") as w:
        x = _sample(0)
        del x["final_hidden"]
        with pytest.raises(ValueError, match="final_hidden is missing"):
            w.append(0, 0, **x)
