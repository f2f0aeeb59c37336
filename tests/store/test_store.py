"""The store: round trips, resume, crash safety under SIGKILL, verify, manifest checks, pickling.

Everything runs on real Zarr stores in tmp dirs; the crash test kills real writer subprocesses.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import time
from pathlib import Path

import pytest
import torch

from dflash.errors import StoreError
from dflash.store import (
    ShardWriter,
    compare_manifest,
    create_or_check_manifest,
    open_store,
    verify_store,
)

H, L, K = 32, 2, 4  # per-layer hidden size, stored layers, top-k
W = H * L
# tiny objects and commits so that a few samples span many of them; no fsync (kill -9 safety does not need
# it, and it dominates the run time of tiny commits); test_round_trip_bf16_exact keeps it on
SMALL = dict(commit_every_tokens=40, chunk_tokens=8, chunks_per_object=4, flush_tokens=32, durable=False)


def manifest(**over) -> dict:
    m = {
        "target": {"path": "/t", "config_hash": "abc", "hidden_size": H, "num_hidden_layers": 4, "vocab_size": 1000},
        "tokenizer_hash": "tok",
        "dataset_fingerprint": "data-v1",
        "target_layer_ids": [1, 2],
        "hidden_dtype": "bf16",
        "topk": K,
        "max_length": 64,
        "num_shards": 1,
    }
    m.update(over)
    return m


def sample(sid: int, topk: int = K) -> dict:
    g = torch.Generator().manual_seed(sid)
    t = 3 + (sid * 7) % 17
    return {
        "input_ids": torch.randint(0, 1000, (t,), generator=g),
        "loss_mask": (torch.rand(t, generator=g) > 0.3).to(torch.uint8),
        "hidden": torch.randn(t, W, generator=g) * torch.linspace(0.01, 20, W),
        "topk_ids": torch.randint(0, 1000, (t, topk), generator=g),
        "topk_logprobs": -torch.rand(t, topk, generator=g) * 5,
    }


def write_shard(root, shard, ids, finalize=True, hidden_dtype="bf16", topk=K, **kw):
    with ShardWriter(root, shard, hidden_width=W, num_layers=L, hidden_dtype=hidden_dtype, topk=topk, **{**SMALL, **kw}) as w:
        for sid in ids:
            w.append(sid, sid, **sample(sid, topk))
        if finalize:
            w.finalize()


def assert_sample(store, sid, exact=True):
    r, x = store.read(sid), sample(sid, store.topk)
    assert torch.equal(r["input_ids"], x["input_ids"]) and r["input_ids"].dtype == torch.int64
    assert torch.equal(r["loss_mask"], x["loss_mask"].bool())
    assert torch.equal(r["topk_ids"], x["topk_ids"]) and torch.equal(r["topk_logprobs"], x["topk_logprobs"])
    assert r["hidden"].dtype == torch.bfloat16 and r["hidden"].shape == (len(x["input_ids"]), W)
    if exact:
        assert torch.equal(r["hidden"].view(torch.int16), x["hidden"].bfloat16().view(torch.int16))
    return r, x


def test_round_trip_bf16_exact(tmp_path):
    root = tmp_path / "s"
    create_or_check_manifest(root, manifest())
    ids = list(range(0, 60, 2))
    write_shard(root, 0, ids, durable=True)
    s = open_store(root)
    assert len(s) == len(ids) and s.sample_ids() == ids
    assert s.lengths().tolist() == [len(sample(i)["input_ids"]) for i in ids]
    assert s.num_supervised().tolist() == [int(sample(i)["loss_mask"].sum()) for i in ids]
    assert (s.hidden_size, s.num_layers, s.target_layer_ids, s.topk) == (H, L, [1, 2], K)
    assert s.manifest["shards"]["shard-00000"]["status"] == "complete" and s.complete
    for sid in ids:
        assert_sample(s, sid)
    part = s.read(ids[3], fields=["input_ids"])
    assert list(part) == ["input_ids"]
    with pytest.raises(KeyError):
        s.read(1)
    rep = verify_store(root)
    assert rep.ok, rep.problem_message()
    assert f"{len(ids)} samples" in rep.summary() and "bytes/token" in rep.summary()


def test_bf16_input_keeps_bits_and_no_topk(tmp_path):
    root = tmp_path / "s"
    create_or_check_manifest(root, manifest(topk=0))
    x = torch.randn(9, W).bfloat16()
    with ShardWriter(root, 0, hidden_width=W, num_layers=L, topk=0) as w:
        staging = x.clone()  # a caller may reuse its (pinned) staging tensor right after append
        w.append(5, 5, torch.arange(9), torch.ones(9), staging)
        staging.zero_()
        w.finalize()
    assert not (root / "shard-00000" / "topk_ids").exists()
    r = open_store(root).read(5)
    assert torch.equal(r["hidden"].view(torch.int16), x.view(torch.int16))
    assert r["topk_ids"].shape == (9, 0) and r["topk_logprobs"].shape == (9, 0)
    assert verify_store(root).ok


def test_compressed_hidden_round_trip(tmp_path):
    root = tmp_path / "s"
    create_or_check_manifest(root, manifest())
    write_shard(root, 0, range(12), hidden_compressor="zstd")
    assert "zstd" in (root / "shard-00000" / "hidden" / "zarr.json").read_text()
    s = open_store(root)
    for sid in range(12):
        assert_sample(s, sid)
    assert verify_store(root).ok


@pytest.mark.parametrize("compressor", [None, "zstd"])
@pytest.mark.parametrize("io", [dict(), dict(overlap_io=False)])
def test_fused_pipeline_writes_the_same_files(tmp_path, compressor, io):
    """fused_pipeline (zarr >= 3.4's FusedCodecPipeline, ignored on older zarr) against zarr's default pipeline:
    the same files, all-zero objects kept (write_empty_chunks), across a reopen and a partial last object."""
    from dflash.store.objects import FUSED

    def zeroed(sid):  # samples 10..19 have all-zero hidden states: whole zero objects (32 tokens each)
        x = sample(sid)
        if 10 <= sid < 20:
            x["hidden"] = torch.zeros_like(x["hidden"])
        return x

    files = {}
    for fused in (False, True):
        root = tmp_path / f"fused{int(fused)}"
        create_or_check_manifest(root, manifest())
        for ids, final in ((range(0, 14), False), (range(14, 30), True)):  # the second writer resumes the shard
            with ShardWriter(root, 0, hidden_width=W, num_layers=L, topk=K, hidden_compressor=compressor,
                             fused_pipeline=fused, **{**SMALL, **io}) as w:
                pipelines = {type(a.async_array.codec_pipeline).__name__ for a in w.arrays.values()}
                want = "FusedCodecPipeline" if fused and FUSED else "BatchedCodecPipeline"
                assert pipelines == {want}
                for sid in ids:
                    w.append(sid, sid, **zeroed(sid))
                if final:
                    w.finalize()
                assert {type(a.async_array.codec_pipeline).__name__ for a in w.arrays.values()} == {want}  # resized
        s = open_store(root)
        for sid in range(30):
            r = s.read(sid)
            assert torch.equal(r["hidden"].view(torch.int16), zeroed(sid)["hidden"].bfloat16().view(torch.int16))
        assert verify_store(root).ok
        files[fused] = _files(root)
    objects = [k for k in files[True] if k.startswith("shard-00000/hidden/c/")]
    total = sum(len(sample(sid)["input_ids"]) for sid in range(30))
    assert len(objects) == -(-total // 32)  # every object exists, the all-zero ones too
    assert files[True] == files[False]


def test_fp8_within_e4m3_tolerance(tmp_path):
    root = tmp_path / "s"
    create_or_check_manifest(root, manifest(hidden_dtype="fp8"))
    ids = list(range(20))
    write_shard(root, 0, ids, hidden_dtype="fp8")
    s = open_store(root)
    assert (root / "shard-00000" / "hidden_scale").is_dir()
    for sid in ids:
        r, x = assert_sample(s, sid, exact=False)
        ref = x["hidden"].float().reshape(len(x["input_ids"]), L, H)
        got = r["hidden"].float().reshape(ref.shape)
        scale = ref.abs().amax(-1, keepdim=True) / 448
        # e4m3 keeps 3 mantissa bits (half-ulp 2^-4 relative), subnormal step 2^-9 * scale, then bf16 rounding
        bound = ref.abs() * (2**-4 + 2**-7) + scale * 2**-9 + 1e-30
        assert ((got - ref).abs() <= bound).all(), sid
        assert (got - ref).abs().max() > 0  # it really was quantised
    assert verify_store(root).ok


class _Samples(torch.utils.data.Dataset):
    def __init__(self, store):
        self.store, self.ids = store, store.sample_ids()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return self.store.read(self.ids[i])


def test_two_shards_and_pickle(tmp_path):
    root = tmp_path / "s"
    create_or_check_manifest(root, manifest(num_shards=2))
    write_shard(root, 0, range(0, 40, 2))
    write_shard(root, 1, range(1, 40, 2))
    s = open_store(root)
    assert s.sample_ids() == list(range(40))
    assert s.index.column("shard").to_pylist() == [i % 2 for i in range(40)]
    assert_sample(s, 7)  # opens arrays in this process
    s2 = pickle.loads(pickle.dumps(s))
    assert s2.sample_ids() == s.sample_ids()
    for sid in (0, 7, 39):
        assert_sample(s2, sid)
    # DataLoader workers, forked after the parent has read (Zarr's IO thread must not be inherited)
    loader = torch.utils.data.DataLoader(
        _Samples(s), batch_size=None, num_workers=2, multiprocessing_context="fork", prefetch_factor=1
    )
    assert [int(b["input_ids"][0]) for b in loader] == [int(sample(i)["input_ids"][0]) for i in range(40)]
    assert verify_store(root).ok


def test_reopen_resumes_and_reader_sees_committed_only(tmp_path):
    root = tmp_path / "s"
    create_or_check_manifest(root, manifest())
    with ShardWriter(root, 0, hidden_width=W, num_layers=L, topk=K, **SMALL) as w:
        for sid in range(10):
            w.append(sid, sid, **sample(sid))
        w.commit()
        w.append(10, 10, **sample(10))
        assert open_store(root).sample_ids() == list(range(10))  # sample 10 is not committed yet
        s = open_store(root)
        assert not s.complete
        for sid in range(10):
            assert_sample(s, sid)  # reads across Zarr objects and the committed tail
    with ShardWriter(root, 0, hidden_width=W, num_layers=L, topk=K, **SMALL) as w:
        assert w.committed_sample_ids() == set(range(11)) and w.committed_source_rows() == set(range(11))
        with pytest.raises(ValueError, match="already"):
            w.append(3, 3, **sample(3))
        for sid in range(11, 25):
            w.append(sid, sid, **sample(sid))
        w.finalize()
    rep = verify_store(root)
    assert rep.ok, rep.problem_message()
    s = open_store(root)
    assert s.sample_ids() == list(range(25))
    for sid in range(25):
        assert_sample(s, sid)
    with pytest.raises(StoreError, match="complete"):
        ShardWriter(root, 0, hidden_width=W, num_layers=L, topk=K).append(99, 99, **sample(99))


def test_writer_refuses_other_settings(tmp_path):
    root = tmp_path / "s"
    create_or_check_manifest(root, manifest())
    write_shard(root, 0, [1, 2], finalize=False)
    with pytest.raises(StoreError, match="topk"):
        ShardWriter(root, 0, hidden_width=W, num_layers=L, topk=2)


def test_manifest_mismatch_and_overwrite(tmp_path):
    root = tmp_path / "s"
    create_or_check_manifest(root, manifest())
    create_or_check_manifest(root, manifest())  # same inputs: fine
    with pytest.raises(StoreError) as e:
        create_or_check_manifest(root, manifest(topk=8, target_layer_ids=[1, 3]))
    msg = str(e.value)
    assert "topk" in msg and "target_layer_ids" in msg and "--overwrite" in msg and "max_length" not in msg
    write_shard(root, 0, [1], finalize=True)
    m = create_or_check_manifest(root, manifest(topk=8), overwrite=True)
    assert m["topk"] == 8 and not (root / "shard-00000").exists()
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x.txt").write_text("x")
    with pytest.raises(StoreError, match="not a dflash store"):
        create_or_check_manifest(tmp_path / "junk", manifest())


def test_compare_manifest_names_mismatches():
    m = manifest()
    ident = dict(m["target"])
    compare_manifest(m, ident, "tok", [1, 2])
    with pytest.raises(StoreError) as e:
        compare_manifest(m, {**ident, "hidden_size": 64, "vocab_size": 5}, "other", [1, 9])
    msg = str(e.value)
    for name in ("hidden size", "vocab size", "tokenizer", "target_layer_ids"):
        assert name in msg
    assert "number of target layers" not in msg


def test_weights_fingerprint_is_compared_only_where_recorded(tmp_path):
    """A store's target weights fingerprint refuses another checkpoint of the same architecture; a store
    written before the fingerprint existed (or a target without safetensors) is not refused for lacking it."""
    fp = {**manifest()["target"], "weights_fingerprint": "a" * 64}
    m = manifest(target=fp)
    with pytest.raises(StoreError, match="weights fingerprint"):
        compare_manifest(m, {**fp, "weights_fingerprint": "b" * 64}, "tok", [1, 2])
    compare_manifest(m, {**fp, "weights_fingerprint": None}, "tok", [1, 2])
    compare_manifest(manifest(), {**fp, "weights_fingerprint": "b" * 64}, "tok", [1, 2])
    root = tmp_path / "s"
    create_or_check_manifest(root, manifest())  # an older store: no fingerprint recorded
    create_or_check_manifest(root, manifest(target=fp))
    create_or_check_manifest(tmp_path / "t", m)
    with pytest.raises(StoreError, match="weights fingerprint"):
        create_or_check_manifest(tmp_path / "t", manifest(target={**fp, "weights_fingerprint": "b" * 64}))


def test_missing_store_named(tmp_path):
    with pytest.raises(StoreError, match="nope"):
        open_store(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreError, match="manifest.json"):
        open_store(tmp_path / "empty")
    with pytest.raises(StoreError, match="nope"):
        verify_store(tmp_path / "nope")


def _flip(path: Path, pos: int) -> None:
    b = bytearray(path.read_bytes())
    b[pos] ^= 0xFF
    path.write_bytes(bytes(b))


def test_verify_names_corrupted_samples(tmp_path):
    root = tmp_path / "s"
    create_or_check_manifest(root, manifest(num_shards=2))
    write_shard(root, 0, range(0, 30, 2))
    write_shard(root, 1, range(1, 30, 2))
    assert verify_store(root).ok
    # hidden is stored uncompressed: a flipped byte decodes fine and only the checksum can catch it
    obj = root / "shard-00001" / "hidden" / "c" / "1" / "0"
    _flip(obj, 300)
    s = open_store(root, verify=False)  # reads unchecked (a checked read raises: tests/store/test_damage.py)
    bad = [sid for sid in s.sample_ids() if not torch.equal(s.read(sid)["hidden"], sample(sid)["hidden"].bfloat16())]
    assert len(bad) == 1
    rep = verify_store(root)
    assert not rep.ok and len(rep.problems) == 1
    assert f"shard-00001 sample {bad[0]}: hidden checksum mismatch" in rep.problem_message()
    assert "1 problem(s)" in rep.summary()
    # compressed ids: break the shard object's index checksum (crc32c) and a compressed byte
    ids_obj = root / "shard-00000" / "input_ids" / "c" / "0"
    _flip(ids_obj, ids_obj.stat().st_size - 1)
    _flip(root / "shard-00000" / "topk_logprobs" / "c" / "1" / "0", 40)
    rep = verify_store(root)  # must not raise
    msg = rep.problem_message()
    assert "shard-00000 sample 0: input_ids" in msg and "topk_logprobs" in msg and f"sample {bad[0]}: hidden" in msg
    assert verify_store(root, checksums=False).ok  # the quick check only reads indexes and shapes


def test_verify_reports_incomplete_and_damaged_index(tmp_path):
    root = tmp_path / "s"
    create_or_check_manifest(root, manifest(num_shards=2))
    write_shard(root, 0, range(10))
    write_shard(root, 1, range(10, 20), finalize=False)
    rep = verify_store(root)
    assert not rep.ok and "shard-00001: not complete" in rep.problem_message()
    assert len(open_store(root)) == 20  # committed samples of the unfinished shard are readable
    segs = sorted((root / "shard-00001" / "index").iterdir())
    assert len(segs) >= 2
    segs[0].unlink()
    rep = verify_store(root)
    assert "shard-00001" in rep.problem_message() and "missing" in rep.problem_message()


# ------------------------------------------------------------------------------------------------
# crash safety: a writer subprocess killed with SIGKILL at chosen instants, then rerun

N_CHILD = 80


def _child_main(root: str, n: int, block_at: str, conn, pace: float = 0.0) -> None:
    """The writer loop of a precompute shard, with an optional pause at a chosen instant (to be killed there).
    `pace`: seconds between appends, so that a kill timed from the parent lands while samples are still
    being written however fast this machine writes them."""
    import zarr.storage._local as zlocal

    from dflash.store import writer as W

    torch.set_num_threads(1)
    kind, _, num = block_at.partition(":")
    num, count = int(num or 0), [0]

    def block_if(k):
        if kind == k:
            count[0] += 1
            if count[0] == num:
                conn.send("BLOCKED")
                while True:
                    time.sleep(1)

    # the instants a kill can land on: before an index segment's rename (data + tail durable), half-way
    # through writing a tmp file, inside a Zarr object write (leaving a torn .partial file), before the
    # fsync of objects, after the consolidated index but before the status file
    real_write, real_put, real_sync, real_mark = W.atomic_write_bytes, zlocal._put, W.ShardWriter._sync, W.mark_shard

    def write(path, data, durable=True):
        path = Path(path)
        if path.name.startswith("seg-"):
            block_if("seg")
        if kind == "tmp" and count[0] + 1 == num:
            path.with_name(f".{path.name}.tmp-{os.getpid()}").write_bytes(bytes(memoryview(data))[: len(data) // 2])
        block_if("tmp")
        return real_write(path, data, durable)

    def put(path, value, exclusive=False):
        if kind == "zput" and count[0] + 1 == num:
            path.with_suffix(".deadbeef.partial").write_bytes(b"torn")
        block_if("zput")
        return real_put(path, value, exclusive=exclusive)

    def sync(self):
        block_if("sync")
        real_sync(self)

    def mark(root, shard, status, stats=None):
        if status == "complete":
            block_if("final")
        real_mark(root, shard, status, stats)

    W.atomic_write_bytes, zlocal._put, W.ShardWriter._sync, W.mark_shard = write, put, sync, mark
    with ShardWriter(root, 0, hidden_width=W_, num_layers=L, topk=K, **SMALL) as w:
        done = w.committed_sample_ids()
        conn.send("RESUME")
        for i in range(n):
            if 3 * i + 1 not in done:
                w.append(3 * i + 1, 3 * i + 1, **sample(3 * i + 1))
                time.sleep(pace)
        w.finalize()
    conn.send("DONE")


W_ = W


def _start(ctx, root, block_at="", pace=0.0):
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_child_main, args=(str(root), N_CHILD, block_at, child, pace))
    p.start()
    child.close()
    return p, parent


def _files(root: Path) -> dict[str, bytes]:
    # every file, status.json and manifest.json included: a store holds no time, so nothing may differ
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _check_committed(root: Path) -> None:
    s = open_store(root)  # what a reader sees after the crash: only whole, correct samples
    assert set(s.sample_ids()) <= {3 * i + 1 for i in range(N_CHILD)}
    for sid in s.sample_ids():
        assert_sample(s, sid)


@pytest.mark.slow
def test_sigkill_at_any_instant_then_rerun_is_identical(tmp_path):
    ref = tmp_path / "ref"  # the uninterrupted run
    create_or_check_manifest(ref, manifest())
    write_shard(ref, 0, [3 * i + 1 for i in range(N_CHILD)])

    # forkserver: real writer processes without paying torch's import for each of them
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "zarr", "pyarrow", "dflash.store", "pytest", __name__])
    root = tmp_path / "crashy"
    create_or_check_manifest(root, manifest())
    # several crashes in a row, each rerun resuming what the last one committed; "final" is last
    for block_at in ["seg:2", "zput:7", "tmp:3", "time:0.05", "sync:4", "seg:3", "time:0.15", "tmp:1", "final:1"]:
        timed = block_at.startswith("time")
        p, conn = _start(ctx, root, "" if timed else block_at, pace=0.01 if timed else 0.0)
        want = "RESUME" if block_at.startswith("time") else "BLOCKED"
        while True:
            assert conn.poll(60), f"{block_at}: child is stuck"
            msg = conn.recv()
            assert msg != "DONE", f"{block_at}: child finished without reaching its kill point"
            if msg == want:
                break
        if block_at.startswith("time"):
            time.sleep(float(block_at.split(":")[1]))
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        assert p.exitcode == -signal.SIGKILL, (block_at, p.exitcode)
        _check_committed(root)
    p, conn = _start(ctx, root)
    p.join(120)
    assert p.exitcode == 0

    assert open_store(root).sample_ids() == open_store(ref).sample_ids() == [3 * i + 1 for i in range(N_CHILD)]
    assert open_store(root).index.equals(open_store(ref).index)
    got, want = _files(root), _files(ref)
    assert sorted(got) == sorted(want)
    assert [k for k in want if got[k] != want[k]] == []
    rep = verify_store(root)
    assert rep.ok, rep.problem_message()
