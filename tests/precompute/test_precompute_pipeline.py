"""The write pipeline of precompute: the GPU-side thread hands batches to a ShardWriter on its own thread.

Everything runs real components (a tiny Qwen3 target, real Zarr stores in tmp dirs); the only
instrument is a ShardWriter subclass whose appends wait on a gate, to hold the writer thread still.
"""

from __future__ import annotations

import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash.config import PrecomputeConfig
from dflash.errors import StoreError
from dflash.precompute.run import prepare, run_precompute
from dflash.precompute.shard import ShardJob, run_shard
from dflash.store import ShardWriter, create_or_check_manifest, open_store, verify_store
from dflash.store.pipeline import WritePipeline
from dflash.store.writer_process import ProcessWritePipeline
from helpers import make_conversations_jsonl

DFLASH = str(Path(sys.executable).with_name("dflash"))


def _files(root: Path) -> dict[str, bytes]:
    """Every file of a store (but the shard lock), byte for byte: a store holds no time, host or rate, so the
    same inputs give the same bytes (its run record is beside it, dflash/store/runinfo.py)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.startswith(".lock")}


def _cfg(target, data, out, **kw) -> PrecomputeConfig:
    # small batches, commits and objects: a dozen samples span many of each
    opts = dict(target=str(target), data=str(data), out=str(out), gpus="cpu", max_length=256, topk=3,
                target_layers=[1, 2], token_budget=300, commit_every_tokens=200, store_chunk_tokens=8)
    opts.update(kw)
    return PrecomputeConfig(**opts)


def _run_shard(cfg: PrecomputeConfig, slots: int = 2) -> Path:
    manifest, layer_ids, _ = prepare(cfg, 1)
    create_or_check_manifest(cfg.out, manifest)
    run_shard(ShardJob(cfg, 0, 1, "cpu", layer_ids, write_slots=slots))
    return Path(cfg.out)


class _InlineSink(ShardWriter):
    """The reference for the pipelines: each sample of a batch copied out and appended on the capture's
    own thread, as plainly as a shard can be written."""

    def submit(self, samples, hidden, topk_ids=None, topk_logprobs=None) -> None:
        for b, sid, row, ids, mask in samples:
            n = len(ids)
            self.append(sid, row, ids, mask, hidden[b, :n], None if topk_ids is None else topk_ids[b, :n],
                        None if topk_logprobs is None else topk_logprobs[b, :n])


@pytest.mark.parametrize("hidden_dtype,writer", [("bf16", "process"), ("fp8", "process"), ("bf16", "thread"), ("fp8", "thread")])
def test_pipelined_precompute_is_byte_identical_to_inline_appends(tmp_path, tiny_target, hidden_dtype, writer,
                                                                  monkeypatch):
    from dflash.precompute import shard

    data = make_conversations_jsonl(tmp_path / "d.jsonl", 14, seed=3)
    with monkeypatch.context() as m:
        m.setattr(shard, "open_sink", lambda writer_args, *_, **__: _InlineSink(**writer_args))
        inline = _run_shard(_cfg(tiny_target, data, tmp_path / "inline", hidden_dtype=hidden_dtype))
    piped = _run_shard(_cfg(tiny_target, data, tmp_path / "piped", hidden_dtype=hidden_dtype, writer=writer))
    want, got = _files(inline), _files(piped)
    assert len(open_store(inline).sample_ids()) == 14
    assert sum(k.startswith("shard-00000/hidden/c/") for k in want) >= 3  # several objects were written
    assert sorted(got) == sorted(want)
    assert [k for k in want if got[k] != want[k]] == []
    assert verify_store(piped).ok


# ---------------------------------------------------------------------------------------------- the pipeline alone

H, L, K = 16, 2, 3
W = H * L


def _store(root: Path) -> Path:
    create_or_check_manifest(root, {
        "target": {"path": "/t", "config_hash": "abc", "hidden_size": H, "num_hidden_layers": 4, "vocab_size": 1000},
        "tokenizer_hash": "tok", "dataset_fingerprint": "d", "target_layer_ids": [1, 2], "hidden_dtype": "bf16",
        "topk": K, "max_length": 64, "num_shards": 1,
    })
    return root


SMALL = dict(hidden_width=W, num_layers=L, topk=K, commit_every_tokens=40, chunk_tokens=8, chunks_per_object=2,
             flush_tokens=16, durable=False)


def _batch(sids: list[int]):
    """A right-padded batch of the samples `sids` (their content a function of the id) and its sample list."""
    lens = [3 + (s * 5) % 11 for s in sids]
    T = max(lens)
    g = torch.Generator().manual_seed(sum(sids))
    hidden = torch.randn(len(sids), T, W, generator=g)
    ids = torch.randint(0, 1000, (len(sids), T, K), generator=g)
    lp = -torch.rand(len(sids), T, K, generator=g)
    samples = [(b, s, s, list(range(s, s + n)), [1] * n) for b, (s, n) in enumerate(zip(sids, lens))]
    return samples, hidden, ids, lp


def _expect(sids_batches):
    out = {}
    for sids in sids_batches:
        samples, hidden, ids, lp = _batch(sids)
        for b, s, _, tok, _ in samples:
            n = len(tok)
            out[s] = (tok, hidden[b, :n].bfloat16(), ids[b, :n], lp[b, :n])
    return out


def _check_store(root: Path, expect: dict) -> None:
    s = open_store(root)
    assert s.sample_ids() == sorted(expect)
    for sid, (tok, h, ids, lp) in expect.items():
        r = s.read(sid)
        assert r["input_ids"].tolist() == tok
        assert torch.equal(r["hidden"].view(torch.int16), h.view(torch.int16))
        assert torch.equal(r["topk_ids"], ids) and torch.equal(r["topk_logprobs"], lp)


class GatedWriter(ShardWriter):
    """A real ShardWriter whose appends wait until the test opens the gate."""

    gate = threading.Event()

    def append_encoded(self, *a, **kw):
        assert self.gate.wait(30)
        return super().append_encoded(*a, **kw)


def test_slots_bound_the_batches_in_flight(tmp_path):
    root = _store(tmp_path / "s")
    plan = [[0, 1, 2], [3, 4], [5, 6, 7, 8], [9], [10, 11]]
    GatedWriter.gate.clear()
    pipe = WritePipeline(GatedWriter(root, 0, **SMALL), "cpu", slots=2)
    submitted = []

    def feed():
        for sids in plan:
            pipe.submit(*_batch(sids))
            submitted.append(sids)

    t = threading.Thread(target=feed)
    t.start()
    try:
        time.sleep(0.5)
        # the writer thread holds batch 0 (gate closed), batch 1 waits in the queue, batch 2 waits for a slot
        assert len(submitted) == 2 and t.is_alive()
        assert pipe.in_flight_max == 2
    finally:
        GatedWriter.gate.set()
        t.join(30)
    assert len(submitted) == len(plan)
    pipe.finalize()
    pipe.close()
    assert pipe.in_flight_max == 2
    assert not pipe._thread.is_alive()
    assert _files(root) and verify_store(root).ok
    _check_store(root, _expect(plan))


def test_writer_thread_error_surfaces_in_the_main_thread(tmp_path):
    root = _store(tmp_path / "s")
    good = [[0, 1], [2, 3, 4], [5]]
    bad_samples, hidden, ids, lp = _batch([6, 7])
    bad_samples[1] = (*bad_samples[1][:4], [1, 1])  # sample 7: a loss mask shorter than its tokens
    with pytest.raises(ValueError, match=r"sample 7: loss_mask has shape \(2,\), expected \(\d+,\)"):
        with WritePipeline(ShardWriter(root, 0, **SMALL), "cpu", slots=2) as pipe:
            for sids in good:
                pipe.submit(*_batch(sids))
            pipe.submit(bad_samples, hidden, ids, lp)
            for k in range(20):  # the error comes back at a later hand-off at the latest
                pipe.submit(*_batch([100 + 2 * k, 101 + 2 * k]))
            pipe.finalize()
    assert not pipe._thread.is_alive()
    # nothing past the failure was committed, the shard is not complete, and what is there is intact
    s = open_store(root)
    assert set(s.sample_ids()) <= {0, 1, 2, 3, 4, 5}
    assert not verify_store(root).ok
    _check_store(root, {k: v for k, v in _expect(good).items() if k in s.sample_ids()})
    # a rerun resumes from what was committed and completes
    with ShardWriter(root, 0, **SMALL) as w, WritePipeline(w, "cpu", slots=2) as pipe:
        _resume(pipe, good, expect_done=set(s.sample_ids()))
    assert verify_store(root).ok
    _check_store(root, _expect(good))


def _write_all(pipe, plan) -> None:
    for sids in plan:
        pipe.submit(*_batch(sids))
    pipe.finalize()


def _resume(pipe, plan, expect_done: set[int]) -> None:
    """A rerun's loop: skip what the pipeline reports committed, submit the rest, finalize."""
    done = pipe.committed_sample_ids()
    assert done == expect_done
    for sids in plan:
        todo = [x for x in _batch(sids)[0] if x[1] not in done]
        pipe.submit(todo, *_batch(sids)[1:])
    pipe.finalize()


def test_io_error_surfaces_and_a_rerun_gives_the_uninterrupted_store(tmp_path):
    plan = [[0, 1, 2], [3, 4], [5, 6, 7, 8], [9], [10, 11]]
    ref = _store(tmp_path / "ref")
    with WritePipeline(ShardWriter(ref, 0, **SMALL), "cpu") as pipe:
        _write_all(pipe, plan)

    root = _store(tmp_path / "s")
    w = ShardWriter(root, 0, **SMALL)
    obstacle = root / "shard-00000" / "hidden" / "c"
    shutil.rmtree(obstacle, ignore_errors=True)
    obstacle.write_text("not a directory")  # Zarr cannot create the objects of `hidden`
    with pytest.raises(OSError) as e:
        with WritePipeline(w, "cpu") as pipe:
            for sids in plan:
                pipe.submit(*_batch(sids))
            pipe.finalize()
    assert isinstance(e.value, (FileExistsError, NotADirectoryError)), repr(e.value)
    assert "hidden/c" in str(e.value)
    with pytest.raises(StoreError, match="an earlier write failed"):
        w.append_encoded(99, 99, [1], [1], {})
    s = open_store(root)
    assert s.sample_ids() == []  # the first commit needed the objects that could not be written
    obstacle.unlink()
    with WritePipeline(ShardWriter(root, 0, **SMALL), "cpu") as pipe:
        for sids in plan:
            pipe.submit(*_batch(sids))
        pipe.finalize()
    assert _files(root) == _files(ref)
    _check_store(root, _expect(plan))


def _limit_file_size(limit: int):
    def apply():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # Python ignores SIGXFSZ: writes fail with EFBIG

    return apply


# thread: commits and 32 KB objects on the writer thread, past a 16 KB limit; process: the shared write
# slots (~80 KB files in /dev/shm) fit under 160 KB, the writer process's 256 KB objects do not
@pytest.mark.parametrize("writer,chunk,limit,where", [("thread", 8, 16384, ("dflash-store", "pipeline.py")),
                                                      ("process", 64, 160 * 1024, ("writer process",))])
@pytest.mark.slow
def test_cli_exits_nonzero_when_the_store_cannot_be_written(tmp_path, tiny_target, writer, chunk, limit, where):
    data = make_conversations_jsonl(tmp_path / "d.jsonl", 14, seed=3)
    store = tmp_path / "s"
    params = tmp_path / "params.yaml"
    params.write_text(f"precompute:\n  token_budget: 300\n  commit_every_tokens: 200\n  store_chunk_tokens: {chunk}\n"
                      f"  writer: {writer}\n")
    args = [DFLASH, "precompute", "--config", str(params), "--target", str(tiny_target), "--data", str(data),
            "--out", str(store), "--gpus", "cpu", "--max-length", "256", "--topk", "3", "--target-layers", "1,2"]
    p = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=tmp_path, preexec_fn=_limit_file_size(limit))
    assert p.returncode != 0
    assert "File too large" in p.stderr, p.stderr[-3000:]
    assert any(w in p.stderr for w in where), p.stderr[-3000:]  # raised where the store is written
    assert not verify_store(store).ok
    run_precompute(_cfg(tiny_target, data, store, store_chunk_tokens=chunk))  # the same inputs: resumes, completes
    ref = run_precompute(_cfg(tiny_target, data, tmp_path / "ref", store_chunk_tokens=chunk)) and tmp_path / "ref"
    assert verify_store(store).ok and open_store(store).sample_ids() == list(range(14))
    assert _files(store) == _files(ref)


@pytest.mark.parametrize("io", [dict(overlap_io=False), dict(io_threads=1), dict(io_threads=3),
                                dict(io_threads=3, fused_pipeline=False)])
def test_io_threads_do_not_change_the_bytes(tmp_path, io):
    plan = [[0, 1, 2], [3, 4], [5, 6, 7, 8], [9], [10, 11], [12, 13, 14]]
    stores = {}
    for name, kw in (("ref", dict(io_threads=2)), ("other", io)):
        root = _store(tmp_path / name)
        with WritePipeline(ShardWriter(root, 0, **SMALL, **kw), "cpu") as pipe:
            for sids in plan:
                pipe.submit(*_batch(sids))
            pipe.finalize()
        stores[name] = _files(root)
    assert stores["other"] == stores["ref"]


def test_row_buffers_are_reused():
    from dflash.store.rows import TokenBuffer

    r = TokenBuffer(np.dtype("uint16"), (4,), 8)  # like the writer: whole objects of 4 rows taken, the rest kept
    seen, want = [], []
    for i in range(6):
        r.append(np.full((5, 4), i, np.uint16))
        want += [i] * 5
        k = len(want) // 4 * 4
        head, lent = r.take(k)
        assert head[:, 0].tolist() == want[:k] and (head == head[:, :1]).all()
        want = want[k:]
        seen.append(lent)
        r.give_back(lent)
    assert r.view()[:, 0].tolist() == want
    assert len({id(b) for b in seen}) == 2  # two buffers take turns: no fresh allocation per flush


# ---------------------------------------------------------------------------------------------- the writer process


def _process_pipe(root: Path, slots: int = 2) -> ProcessWritePipeline:
    return ProcessWritePipeline(dict(store_path=root, shard_index=0, **SMALL), "cpu", slots=slots, capacity_tokens=64)


def test_process_writer_stores_what_the_thread_writer_stores(tmp_path):
    plan = [[0, 1, 2], [3, 4], [5, 6, 7, 8], [9], [10, 11], [12, 13, 14]]
    ref = _store(tmp_path / "ref")
    with WritePipeline(ShardWriter(ref, 0, **SMALL), "cpu") as pipe:
        _write_all(pipe, plan)
    root = _store(tmp_path / "s")
    with _process_pipe(root) as pipe:
        assert pipe.committed_sample_ids() == set()
        _write_all(pipe, plan)
    pipe._proc.join(30)
    assert pipe._proc.exitcode == 0 and pipe.in_flight_max <= 2
    assert _files(root) == _files(ref)
    _check_store(root, _expect(plan))


def test_process_writer_error_surfaces_and_the_rerun_resumes(tmp_path):
    root = _store(tmp_path / "s")
    good = [[0, 1], [2, 3, 4], [5]]
    with pytest.raises(StoreError, match=r"writer process failed with ValueError: sample 7: loss_mask has shape"):
        with _process_pipe(root) as pipe:
            for sids in good:
                pipe.submit(*_batch(sids))
            bad_samples, hidden, ids, lp = _batch([6, 7])
            bad_samples[1] = (*bad_samples[1][:4], [1, 1])  # sample 7: a loss mask shorter than its tokens
            pipe.submit(bad_samples, hidden, ids, lp)
            for k in range(50):  # the error comes back at a later hand-off at the latest
                pipe.submit(*_batch([100 + 2 * k, 101 + 2 * k]))
            pipe.finalize()
    pipe._proc.join(30)
    assert pipe._proc.exitcode is not None
    s = open_store(root)
    assert set(s.sample_ids()) <= {0, 1, 2, 3, 4, 5} and not verify_store(root).ok
    # a rerun: the writer process reports what was committed, the rest is written, the shard completes
    with _process_pipe(root) as pipe:
        _resume(pipe, good, expect_done=set(s.sample_ids()))
    assert verify_store(root).ok
    _check_store(root, _expect(good))


def test_process_writer_refuses_a_shard_written_with_other_settings(tmp_path):
    root = _store(tmp_path / "s")
    with _process_pipe(root) as pipe:
        pipe.submit(*_batch([0, 1]))
        pipe.finalize()
    other = dict(store_path=root, shard_index=0, **{**SMALL, "topk": K + 1})
    with pytest.raises(StoreError, match="was written with other settings"):
        ProcessWritePipeline(other, "cpu", slots=1, capacity_tokens=64)
