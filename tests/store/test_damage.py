"""Damage caught where data is read: what `dflash verify` finds, `open_store` and `Store.read` refuse too.

Every test damages a copy of a real store (precomputed once from the tiny target, conftest's `tiny_store`)
on disk, the way a user or a failing disk would, and checks the refusal names the file / shard / sample /
key and says what to do.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash.errors import StoreError
from dflash.store import open_store, verify_store

SHARD = "shard-00000"


@pytest.fixture
def store(tiny_store, tmp_path) -> Path:
    """A private copy of the session's tiny store (1 shard, 24 samples, layers [1, 2], top-4), to damage."""
    _, _, src = tiny_store
    dst = tmp_path / "store"
    shutil.copytree(src, dst)
    return dst


def _edit_manifest(store: Path, fn) -> None:
    p = store / "manifest.json"
    m = json.loads(p.read_text())
    fn(m)
    p.write_text(json.dumps(m))


def _flip(path: Path, at: int) -> None:
    b = bytearray(path.read_bytes())
    b[at] ^= 0xFF
    path.write_bytes(bytes(b))


def _sample_at_token(s, token: int) -> int:
    """The sample id whose rows hold token `token` of the (only) shard."""
    off = s.index.column("offset").to_numpy()
    ln = s.index.column("length").to_numpy()
    i = int(np.flatnonzero((off <= token) & (token < off + ln))[0])
    return int(s.index.column("sample_id")[i].as_py())


def _assert_damage_message(msg: str, store: Path, sid: int, field: str) -> None:
    assert f"sample {sid} in {SHARD}" in msg and field in msg
    assert f"dflash verify {store}" in msg and "new store" in msg
    assert "Traceback" not in msg


# ---------------------------------------------------------------------------------------------------
# per sample: checksums on read


def test_clean_store_opens_complete_and_reads_verified(store):
    s = open_store(store, require_complete=True)
    assert len(s) == 24 and s.complete
    for sid in s.sample_ids():
        a, b = s.read(sid), s.read(sid, verify=False)
        assert all(torch.equal(a[k], b[k]) for k in a)
        out = torch.empty(len(a["input_ids"]), a["hidden"].shape[1], dtype=torch.bfloat16)
        s.read_hidden_into(sid, out)
        assert torch.equal(out, a["hidden"])


def test_changed_hidden_byte_is_refused_on_read(store):
    """hidden is uncompressed: a changed byte decodes fine, only the checksum can tell."""
    s0 = open_store(store)
    width = s0.hidden_size * s0.num_layers
    token = 1000
    _flip(store / SHARD / "hidden" / "c" / "0" / "0", token * width * 2 + 5)
    sid = _sample_at_token(s0, token)
    s = open_store(store, require_complete=True)  # open reads no data: it cannot see this
    with pytest.raises(StoreError) as e:
        s.read(sid)
    _assert_damage_message(str(e.value), store, sid, "hidden")
    n = int(s.lengths()[s.sample_ids().index(sid)])
    with pytest.raises(StoreError, match=f"sample {sid} in {SHARD} is damaged: its hidden rows"):
        s.read_hidden_into(sid, torch.empty(n, width, dtype=torch.bfloat16))
    # a read of only the first rows (the loader cuts long samples) still checks the whole sample
    with pytest.raises(StoreError, match=f"sample {sid} in {SHARD}"):
        s.read_hidden_into(sid, torch.empty(1, width, dtype=torch.bfloat16))
    s.read(sid, fields=["input_ids", "loss_mask"])  # the other arrays are intact
    s.read(sid, verify=False)  # unchecked reads still return (the garbage)
    others = [x for x in s.sample_ids() if x != sid]
    for x in others:
        s.read(x)
    rep = verify_store(store)
    assert rep.problems == [f"{SHARD} sample {sid}: hidden checksum mismatch (stored bytes changed)"]


def test_missing_hidden_chunk_reads_zeros_and_is_caught(store):
    """Zarr returns the fill value (zeros) for a chunk object that is not there: only the checksum knows."""
    obj = store / SHARD / "hidden" / "c" / "0" / "0"
    obj.unlink()
    s = open_store(store, require_complete=True)
    sid = s.sample_ids()[0]
    assert not s.read(sid, verify=False)["hidden"].any()  # silently zeros without the check
    with pytest.raises(StoreError) as e:
        s.read(sid)
    _assert_damage_message(str(e.value), store, sid, "hidden")
    assert "missing and read back as zeros" in str(e.value)
    assert any(f"sample {sid}: hidden checksum mismatch" in p for p in verify_store(store).problems)


def test_garbled_compressed_object_names_shard_and_array(store):
    obj = store / SHARD / "input_ids" / "c" / "0"
    _flip(obj, obj.stat().st_size - 1)  # the sharding codec's index checksum
    s = open_store(store)
    with pytest.raises(StoreError) as e:
        s.read(s.sample_ids()[0], fields=["input_ids"])
    msg = str(e.value)
    assert f"{SHARD}: rows" in msg and "input_ids cannot be decoded" in msg and "dflash verify" in msg


@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_a_chunk_its_codec_cannot_decompress_is_one_message_in_any_process(store, num_workers):
    """A flipped byte in the header of a compressed input_ids chunk makes blosc raise a RuntimeError of its
    own: read by the training process (0: Store.read, as the banner's agreement with the target does) or
    by a loader worker, it is the shard's StoreError naming the array, not a traceback."""
    from dflash.train import loader as L

    _flip(store / SHARD / "input_ids" / "c" / "0", 0)
    s = open_store(store, require_complete=True)
    with pytest.raises(StoreError) as e:
        if num_workers == 0:
            s.read(s.sample_ids()[0], fields=["input_ids"])
        else:
            spec = L.LoaderSpec(block_size=4, num_anchors=4, token_budget=256, block_budget=128, rows_per_batch=2,
                                mask_token_id=0, seed=0)
            ds = L.PackedDataset(s, spec)
            list(L.make_loader(ds, L.RankSampler(ds, 0, 1, 1, 0, 0, 1), num_workers=num_workers))
    msg = str(e.value)
    assert f"{SHARD}: rows" in msg and "of input_ids cannot be decoded" in msg and "cannot be decompressed" in msg
    assert f"dflash verify {store}" in msg and "Traceback" not in msg and "Caught" not in msg


def test_loader_worker_reports_damage_as_one_message(store):
    """In a real DataLoader worker process: the training process gets the StoreError with the worker's
    message, not torch's "Caught StoreError in DataLoader worker process 0 ... Original Traceback"."""
    from dflash.train import loader as L

    (store / SHARD / "hidden" / "c" / "0" / "0").unlink()
    s = open_store(store, require_complete=True)
    spec = L.LoaderSpec(block_size=4, num_anchors=4, token_budget=256, block_budget=128, rows_per_batch=2,
                        mask_token_id=0, seed=0)
    ds = L.PackedDataset(s, spec)
    with pytest.raises(StoreError) as e:
        list(L.make_loader(ds, L.RankSampler(ds, 0, 1, 1, 0, 0, 1), num_workers=1))
    msg = str(e.value)
    assert msg.startswith(f"store {store}: sample ") and "is damaged: its hidden rows" in msg
    assert "Traceback" not in msg and "Caught" not in msg
    assert "Original Traceback" in e.value.worker_traceback  # kept for --debug


# ---------------------------------------------------------------------------------------------------
# at open: structure, without reading data


def test_deleted_array_metadata_refused_at_open(store):
    (store / SHARD / "hidden" / "zarr.json").unlink()
    with pytest.raises(StoreError) as e:
        open_store(store)
    msg = str(e.value)
    assert f"{SHARD}/hidden/zarr.json" in msg and "is missing" in msg and f"dflash verify {store}" in msg
    rep = verify_store(store, checksums=False)
    assert len(rep.problems) == 1 and "hidden/zarr.json" in rep.problems[0]


def test_index_longer_than_arrays_refused_at_open(store):
    meta = store / SHARD / "topk_ids" / "zarr.json"
    m = json.loads(meta.read_text())
    end = m["shape"][0]
    m["shape"][0] = end - 10
    meta.write_text(json.dumps(m))
    with pytest.raises(StoreError, match=f"array topk_ids has {end - 10} rows, the index needs {end}"):
        open_store(store)
    assert not verify_store(store, checksums=False).ok


def test_missing_index_of_complete_shard_refused(store):
    (store / SHARD / "index.arrow").unlink()
    with pytest.raises(StoreError, match=f"{SHARD} is marked complete but .*index.arrow is missing"):
        open_store(store)
    assert any("never consolidated" in p for p in verify_store(store).problems)


@pytest.mark.parametrize("key,edit,named", [
    ("num_shards", lambda m: m.update(num_shards="two"), "`num_shards` is 'two'"),
    ("num_shards", lambda m: m.pop("num_shards"), "no `num_shards` key"),
    ("num_shards", lambda m: m.update(num_shards=True), "`num_shards` is True"),
    ("target_layer_ids", lambda m: m.update(target_layer_ids="1,2"), "`target_layer_ids` is '1,2'"),
    ("target_layer_ids", lambda m: m.pop("target_layer_ids"), "no `target_layer_ids` key"),
    ("target", lambda m: m.update(target=None), "`target` is None"),
    ("target.hidden_size", lambda m: m["target"].update(hidden_size="64"), "`target.hidden_size` is '64'"),
    ("topk", lambda m: m.update(topk=-1), "`topk` is -1"),
    ("hidden_dtype", lambda m: m.update(hidden_dtype="fp16"), "`hidden_dtype` is 'fp16'"),
])
def test_malformed_manifest_names_the_key(store, key, edit, named):
    _edit_manifest(store, edit)
    for fn in (open_store, verify_store):
        with pytest.raises(StoreError) as e:
            fn(store)
        msg = str(e.value)
        assert named in msg and str(store / "manifest.json") in msg and "new store" in msg, msg


def test_verify_command_prints_manifest_damage_without_traceback(store):
    from click.testing import CliRunner

    from dflash.cli import main

    _edit_manifest(store, lambda m: m.update(num_shards="two"))
    r = CliRunner().invoke(main, ["verify", str(store)])
    assert r.exit_code == 1 and "error: " in r.output and "`num_shards` is 'two'" in r.output
    assert "Traceback" not in r.output


def test_edited_target_layer_ids_refused(store, tiny_store, tmp_path):
    target, _, _ = tiny_store
    # another layer count: against what precompute recorded, and against the hidden array's row width
    _edit_manifest(store, lambda m: m.update(target_layer_ids=[1, 2, 3]))
    with pytest.raises(StoreError, match=r"`target_layer_ids` \[1, 2, 3\] differs from the layers precompute captured"):
        open_store(store)
    _edit_manifest(store, lambda m: m.pop("precompute_config"))
    with pytest.raises(StoreError, match=r"array hidden is uint16\[2258, 128\], expected uint16 rows of \[192\]") as e:
        open_store(store)
    assert "target_layer_ids" in str(e.value)
    # the same count, other layers: only the record of the run can tell
    shutil.rmtree(store)
    shutil.copytree(tiny_store[2], store)
    _edit_manifest(store, lambda m: m.update(target_layer_ids=[0, 2]))
    from dflash.config import TrainConfig
    from dflash.train.preflight import preflight

    cfg = TrainConfig(store=str(store), target=str(target), out=str(tmp_path / "run"), gpus="cpu:1", num_workers=1)
    with pytest.raises(StoreError, match=r"`target_layer_ids` \[0, 2\] differs"):
        preflight(cfg)
    _edit_manifest(store, lambda m: m.update(target_layer_ids=[1, 9]))  # past the target's 4 layers
    with pytest.raises(StoreError, match=r"names layers past the target's 4"):
        preflight(cfg)
    assert not (tmp_path / "run").exists()


def test_shard_count_against_directories(store):
    _edit_manifest(store, lambda m: m.update(num_shards=2))
    with pytest.raises(StoreError, match="part 0 has 1 shards.*says 2; one of them was edited"):
        open_store(store)  # the part record (dflash/store/parts.py) disagrees with the edited manifest
    shutil.rmtree(store / "parts")  # as a store written before parts: the shard directories are what is left
    open_store(store)  # a reader of what was committed may open it ...
    with pytest.raises(StoreError) as e:  # ... training and evaluation may not
        open_store(store, require_complete=True)
    msg = str(e.value)
    assert "shard-00001 pending (no directory)" in msg and "rerun the same `dflash precompute`" in msg
    assert "--overwrite" not in msg
    assert any("shard-00001: no shard directory" in p for p in verify_store(store).problems)
    # fewer shards in the manifest than on disk
    _edit_manifest(store, lambda m: m.update(num_shards=1))
    shutil.copytree(store / SHARD, store / "shard-00001")
    with pytest.raises(StoreError, match=r"num_shards 1, but shard directories \['shard-00001'\] exist past it"):
        open_store(store)
    assert any("shard-00001: a shard directory past the manifest's num_shards 1" in p
               for p in verify_store(store).problems)


def test_running_shard_refused_for_training(store, tiny_store, tmp_path):
    status = store / SHARD / "status.json"
    status.write_text(json.dumps({**json.loads(status.read_text()), "status": "running"}))
    assert len(open_store(store)) == 24  # the committed samples stay readable to tools that ask for them
    from dflash.config import TrainConfig
    from dflash.train.preflight import preflight

    target, _, _ = tiny_store
    cfg = TrainConfig(store=str(store), target=str(target), out=str(tmp_path / "run"), gpus="cpu:1", num_workers=1)
    with pytest.raises(StoreError) as e:
        preflight(cfg)
    msg = str(e.value)
    assert f"store {store} is not complete" in msg and f"{SHARD} running" in msg
    assert "still writing" in msg and "interrupted" in msg and "rerun the same `dflash precompute`" in msg
    assert "--overwrite" not in msg


# ---------------------------------------------------------------------------------------------------
# disk full while writing


@pytest.mark.slow  # ~16 s: a real precompute into a full tmpfs
def test_disk_full_during_precompute(tiny_store, full_disk):
    from helpers import build_store

    target, data, _ = tiny_store
    out = full_disk / "store"
    with pytest.raises(StoreError) as e:
        # the estimate would refuse this store before writing (tests/precompute/test_space.py): here the
        # writes themselves must meet the full disk
        build_store(out, target, data, store_chunk_tokens=64, space_check=False)
    msg = str(e.value)
    assert "no space left on the device while writing " + str(out) in msg
    assert "Free space" in msg and "rerun the same `dflash precompute`" in msg and "Traceback" not in msg


def test_disk_full_at_fsync(tmp_path, monkeypatch):
    """ENOSPC where a filesystem with delayed allocation reports it: fsync of a commit's index segment."""
    from dflash.store import ShardWriter, create_or_check_manifest

    root = tmp_path / "s"
    create_or_check_manifest(root, {
        "target": {"path": "/t", "config_hash": "c", "hidden_size": 8, "num_hidden_layers": 4, "vocab_size": 100},
        "tokenizer_hash": "t", "dataset_fingerprint": "d", "target_layer_ids": [1, 2], "hidden_dtype": "bf16",
        "topk": 0, "max_length": 64, "num_shards": 1})
    w = ShardWriter(root, 0, hidden_width=16, num_layers=2, commit_every_tokens=10**6, chunk_tokens=8,
                    chunks_per_object=2, overlap_io=False)
    w.append(0, 0, torch.arange(5), torch.ones(5), torch.randn(5, 16))
    real = os.fsync

    def fsync(fd):  # the commit's atomic writes (tail, then index segment) go through a .tmp- file
        if ".tmp-" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(StoreError) as e:
        w.commit()
    msg = str(e.value)
    assert "no space left on the device while writing " + str(root / SHARD / "tail-") in msg  # the tail comes first
    assert "Free space" in msg and "rerun" in msg
    assert not list((root / SHARD).rglob(".*.tmp-*"))  # the temporary file is not left behind
    monkeypatch.setattr(os, "fsync", real)
    w.abort()


def test_training_on_a_damaged_store_stops_with_one_message(store, tiny_store, tmp_path):
    """`dflash train` itself: the store opens (nothing is wrong with its structure), the first batch that
    holds the damaged sample stops the run with the worker's message, no DataLoader traceback."""
    from click.testing import CliRunner

    from dflash.cli import main

    target, _, _ = tiny_store
    (store / SHARD / "hidden" / "c" / "0" / "0").unlink()
    (tmp_path / "params.yaml").write_text("train: {}\n")  # not the repository's params.yaml
    args = ["train", "--config", str(tmp_path / "params.yaml"), "--store", str(store), "--target", str(target),
            "--out", str(tmp_path / "run"), "--gpus", "cpu:1", "--steps", "2", "--block-size", "4", "--num-layers", "1", "--token-budget", "256",
            "--num-workers", "1", "--compile", "off", "--save-every", "0"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 1, r.output
    err = r.output[r.output.index("error: "):]  # after the progress bar
    assert err.startswith(f"error: store {store}: sample ") and f"in {SHARD} is damaged: its hidden rows" in err
    assert f"dflash verify {store}" in err and "Traceback" not in r.output


def test_skip_damaged_trains_on_and_counts_the_damaged_sample(store, tiny_store, tmp_path):
    """`--skip-damaged`: the one sample whose hidden bytes changed is left out of its batch, named on
    stderr and counted in metrics.jsonl; every other sample of the epoch is trained on."""
    import subprocess
    import sys

    target, _, _ = tiny_store
    s0 = open_store(store)
    token = 700
    _flip(store / SHARD / "hidden" / "c" / "0" / "0", token * s0.hidden_size * s0.num_layers * 2 + 3)
    sid = _sample_at_token(s0, token)
    (tmp_path / "params.yaml").write_text("train: {}\n")
    args = [sys.executable, "-m", "dflash.cli", "train", "--config", str(tmp_path / "params.yaml"), "--store",
            str(store), "--target", str(target), "--out", str(tmp_path / "run"), "--gpus", "cpu:1", "--epochs", "1",
            "--block-size", "4", "--num-layers", "1", "--token-budget", "256", "--num-workers", "1",
            "--compile", "off", "--save-every", "0", "--skip-damaged"]
    p = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"skipping damaged sample {sid} in {SHARD} (hidden fails its checksum" in p.stderr
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["damaged_skipped"] for r in rows) == 1
    assert sum(r["samples"] for r in rows) == len(s0) - 1  # one epoch: every other sample once


def test_a_store_of_another_format_is_refused_in_one_message(store, tiny_store):
    """Reading and writing alike: the store is named and the way out is to recapture it."""
    from click.testing import CliRunner

    from dflash.cli import main
    from dflash.store import create_or_check_manifest

    _edit_manifest(store, lambda m: m.update(format_version=1))
    want = rf"store {store} has format_version 1, and this dflash reads and writes only 2: recapture it"
    with pytest.raises(StoreError, match=want):
        open_store(store)
    with pytest.raises(StoreError, match=want):
        create_or_check_manifest(store, json.loads((store / "manifest.json").read_text()))
    target, data, _ = tiny_store
    res = CliRunner().invoke(main, ["precompute", "--target", str(target), "--data", str(data), "--out", str(store),
                                    "--gpus", "cpu", "--target-layers", "1,2", "--topk", "4"])
    assert res.exit_code != 0 and "recapture it" in res.output and "Traceback" not in res.output, res.output


def test_a_reader_between_a_commit_and_its_tail_removal_looks_again(tmp_path, monkeypatch):
    """The writer commits segment n+1, then removes the tail segment n named: a reader that listed the
    segments just before finds that tail gone.  That is a moving shard, not damage: it must list them
    again and get the newer state.  A tail missing while the shard stays put is still damage."""
    import numpy as np
    import pytest

    from dflash.errors import StoreError
    from dflash.store import ShardWriter, layout

    rng = np.random.default_rng(0)
    w = ShardWriter(tmp_path, 0, hidden_width=64, num_layers=2, topk=4, chunk_tokens=16, chunks_per_object=4,
                    commit_every_tokens=10**9)
    names = tuple(w.specs)

    def add(i):
        t = 7
        w.append_encoded(i, i, rng.integers(0, 1000, t), np.ones(t, np.uint8),
                         {"hidden": rng.integers(0, 2**16, (t, 64)).astype(np.uint16),
                          "topk_ids": rng.integers(0, 1000, (t, 4)).astype(np.int32),
                          "topk_logprobs": -rng.random((t, 4)).astype(np.float32)})

    add(0)
    w.commit()
    shard = w.dir
    stale = layout.load_committed(shard, names)
    assert stale.tail is not None and stale.tail.is_file()
    add(1)
    w.commit()  # a new tail; the one `stale` names is removed
    assert not stale.tail.is_file()
    real = layout._load_committed_once
    calls = []

    def first_stale(d, a):
        calls.append(d)
        return stale if len(calls) == 1 else real(d, a)

    monkeypatch.setattr(layout, "_load_committed_once", first_stale)
    got = layout.load_committed(shard, names)
    assert got.num_segments == 2 and got.end > stale.end and got.tail.is_file() and len(calls) >= 2
    monkeypatch.setattr(layout, "_load_committed_once", real)
    got.tail.unlink()  # now the shard does not move on: damage
    with pytest.raises(StoreError, match="is missing; shard .* is damaged"):
        layout.load_committed(shard, names)


@pytest.mark.slow
@pytest.mark.parametrize("array", [
    "topk_ids",  # read first by the training process (the banner's agreement with the target), workers running
    "hidden",  # read only by the loader workers
    "input_ids",  # read by both, whichever comes first; the byte breaks the compressed chunk's header
])
def test_one_flipped_byte_stops_a_whole_epoch_with_one_message_whoever_reads_it(store, tiny_store, tmp_path, array):
    """One changed byte in a chunk of `array`, a whole epoch on two loader workers: the run stops with the
    one-paragraph message and exit status 1, and no process (the trainer, a worker still sending a
    micro-batch or waiting for its batch slot) prints a traceback on its way out."""
    import subprocess
    import sys

    target, _, _ = tiny_store
    obj = next(p for p in sorted((store / SHARD / array / "c").rglob("*")) if p.is_file())
    s0 = open_store(store)  # raw hidden rows: a byte of token 700's (the object is longer than its rows)
    at = {"topk_ids": obj.stat().st_size // 2, "hidden": 700 * s0.hidden_size * s0.num_layers * 2 + 3, "input_ids": 0}
    _flip(obj, at[array])
    (tmp_path / "params.yaml").write_text("train: {}\n")
    args = [sys.executable, "-m", "dflash.cli", "train", "--config", str(tmp_path / "params.yaml"), "--store",
            str(store), "--target", str(target), "--out", str(tmp_path / "run"), "--gpus", "cpu:1", "--epochs", "1",
            "--block-size", "4", "--num-layers", "1", "--token-budget", "256", "--num-workers", "2",
            "--compile", "off", "--save-every", "0"]
    p = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 1, p.stderr[-3000:]
    assert "error: " in p.stderr and f"dflash verify {store}" in p.stderr and array in p.stderr, p.stderr[-3000:]
    assert "Traceback" not in p.stderr + p.stdout and "Caught" not in p.stderr, p.stderr[-3000:]
