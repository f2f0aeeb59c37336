"""DirectObjects writes the objects zarr writes, byte for byte, and a shard written through it is the shard
zarr's own path writes."""

from __future__ import annotations

import numpy as np
import pytest

from dflash.store import ShardWriter, layout
from dflash.store.direct import DirectObjects, DirectReads
from dflash.store.objects import object_path, open_arrays


def _rows(rng, dtype, shape):
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    return rng.integers(0, min(np.iinfo(dtype).max, 60000), shape).astype(dtype)


@pytest.mark.parametrize("hidden_dtype,compressor", [("bf16", None), ("fp8", None), ("bf16", "zstd")])
def test_objects_equal_zarrs(tmp_path, hidden_dtype, compressor):
    specs = layout.array_specs(hidden_dtype, 96, 3, 8, final_hidden=True)
    S, ci = 64, 16
    made = {d: open_arrays(tmp_path / d, specs, {"hidden_dtype": hidden_dtype}, S, ci, compressor, False)
            for d in ("zarr", "direct")}
    rng = np.random.default_rng(0)
    for name, (dtype, row) in specs.items():
        x = _rows(rng, dtype, (2 * S, *row))
        x[:5] = 0  # an all-zero inner chunk is written too (write_empty_chunks)
        made["zarr"][name].resize((2 * S, *row))
        made["zarr"][name][:] = x
        enc = DirectObjects.of(made["direct"][name])
        assert enc is not None, name
        for k in range(2):
            enc.write(object_path(tmp_path / "direct", name, row, k), x[k * S : (k + 1) * S])
            ours = object_path(tmp_path / "direct", name, row, k).read_bytes()
            assert ours == object_path(tmp_path / "zarr", name, row, k).read_bytes(), (name, k)
        made["direct"][name].resize((2 * S, *row))
        np.testing.assert_array_equal(made["direct"][name][:], x)


def _write_shard(root, direct: bool, n_samples: int = 40):
    rng = np.random.default_rng(1)
    w = ShardWriter(root, 0, hidden_width=64, num_layers=2, topk=4, chunk_tokens=16, chunks_per_object=4,
                    commit_every_tokens=100, direct_objects=direct)
    for i in range(n_samples):
        t = int(rng.integers(5, 60))
        w.append_encoded(i, i, rng.integers(0, 1000, t), np.ones(t, np.uint8),
                         {"hidden": rng.integers(0, 2**16, (t, 64)).astype(np.uint16),
                          "topk_ids": rng.integers(0, 1000, (t, 4)).astype(np.int32),
                          "topk_logprobs": -rng.random((t, 4)).astype(np.float32)})
    stages = w.stage_times()
    w.finalize()
    return stages


def test_shard_bytes_equal_zarrs_path(tmp_path):
    stages = _write_shard(tmp_path / "direct", True)
    _write_shard(tmp_path / "zarr", False)
    assert stages["objects"] > 0 and stages["commits"] > 0  # whole objects went through DirectObjects
    for d in ("input_ids", "loss_mask", "hidden", "topk_ids", "topk_logprobs"):
        ours = sorted(p.relative_to(tmp_path / "direct") for p in (tmp_path / "direct" / "shard-00000" / d).rglob("*")
                      if p.is_file())
        theirs = sorted(p.relative_to(tmp_path / "zarr") for p in (tmp_path / "zarr" / "shard-00000" / d).rglob("*")
                        if p.is_file())
        assert ours == theirs and ours
        for p in ours:
            assert (tmp_path / "direct" / p).read_bytes() == (tmp_path / "zarr" / p).read_bytes(), p
    ia = layout.read_ipc(tmp_path / "direct" / "shard-00000" / layout.INDEX)
    ib = layout.read_ipc(tmp_path / "zarr" / "shard-00000" / layout.INDEX)
    assert ia.equals(ib)


def test_unhandled_codecs_fall_back(tmp_path):
    import zarr
    from zarr.storage import LocalStore

    g = zarr.open_group(LocalStore(tmp_path / "g"), mode="w")
    plain = g.create_array(name="plain", shape=(0, 4), dtype="uint16", chunks=(16, 4))  # no sharding codec
    assert DirectObjects.of(plain) is None


def test_codec_settings_as_strings_are_understood(tmp_path):
    """zarr 3.4 holds a codec's endian, cname and shuffle as strings where zarr 3.1 holds Enums (the GPU
    image's zarr 3.4.2 failed here with AttributeError): the same arrays must still be written directly,
    to the same bytes."""
    import dataclasses

    specs = layout.array_specs("bf16", 96, 3, 8)
    S, ci = 64, 16
    arrays = open_arrays(tmp_path / "a", specs, {"hidden_dtype": "bf16"}, S, ci, "zstd", False)
    arr = arrays["hidden"]
    sc = arr.metadata.codecs[0]

    def _forced(obj, changed):  # zarr's codecs and metadata are frozen dataclasses
        out = dataclasses.replace(obj)
        for k, v in changed.items():
            object.__setattr__(out, k, v)
        return out

    def as_strings(codec):  # every Enum setting replaced by its string value, as zarr 3.4 holds them
        fields = {f.name: getattr(codec, f.name) for f in dataclasses.fields(codec)}
        return _forced(codec, {k: v.value for k, v in fields.items() if isinstance(getattr(v, "value", None), str)})

    strung = _forced(sc, {"index_codecs": tuple(as_strings(c) for c in sc.index_codecs),
                          "codecs": tuple(as_strings(c) for c in sc.codecs)})
    assert isinstance(strung.index_codecs[0].endian, str)  # the test really feeds strings
    fake = type("A", (), {"metadata": _forced(arr.metadata, {"codecs": (strung,)}), "dtype": arr.dtype})()
    ours, theirs = DirectObjects.of(fake), DirectObjects.of(arr)
    assert ours is not None and theirs is not None
    x = np.random.default_rng(0).integers(0, 2**16, (S, *specs["hidden"][1])).astype(np.uint16)
    assert b"".join(bytes(b) for b in ours.encode(x)) == b"".join(bytes(b) for b in theirs.encode(x))


@pytest.mark.parametrize("hidden_dtype,compressor,cache", [("bf16", None, None), ("fp8", None, None),
                                                          ("bf16", "zstd", None), ("bf16", None, 1)])
def test_direct_reads_equal_zarrs(tmp_path, hidden_dtype, compressor, cache):
    """Every array of a shard, any row range (inside an inner chunk, across chunks, across objects, into
    the partial last object finalize writes): the rows zarr decodes.  Raw chunks are read in place, compressed
    ones decoded through the cache (cache=1 byte: evicted after every chunk)."""
    specs = layout.array_specs(hidden_dtype, 96, 3, 8, final_hidden=True)
    S, ci = 64, 16
    arrays = open_arrays(tmp_path, specs, {"hidden_dtype": hidden_dtype}, S, ci, compressor, False)
    rng = np.random.default_rng(2)
    n = 2 * S + 23
    ranges = [(0, n), (0, 1), (5, 21), (15, 17), (60, 70), (63, 130), (2 * S, n), (n - 1, n)]
    ranges += [tuple(sorted(rng.choice(n + 1, 2, replace=False))) for _ in range(20)]
    for name, (dtype, row) in specs.items():
        x = _rows(rng, dtype, (n, *row))
        arrays[name].resize((n, *row))
        arrays[name][:] = x
        reads = DirectReads.of(arrays[name], tmp_path / name)
        assert reads is not None, name
        raw = name in ("hidden", "final_hidden") and compressor is None
        assert (reads.compressor is None) == raw, name
        if cache is not None:
            reads.CACHE_BYTES = cache
        for lo, hi in ranges:
            out = np.full((hi - lo, *row), 7, dtype=dtype)
            reads.read_into(int(lo), int(hi), out)
            np.testing.assert_array_equal(out, x[lo:hi], err_msg=f"{name} [{lo}, {hi})")
            np.testing.assert_array_equal(out, arrays[name][lo:hi])
        if not raw:
            assert 1 <= len(reads._decoded) <= (1 if cache else S // ci * 3)


def test_direct_reads_refuse_a_damaged_index_and_read_a_missing_object_as_zeros(tmp_path):
    specs = layout.array_specs("bf16", 32, 2, 4)
    S, ci = 64, 16
    arrays = open_arrays(tmp_path, specs, {"hidden_dtype": "bf16"}, S, ci, None, False)
    dtype, row = specs["hidden"]
    x = _rows(np.random.default_rng(3), dtype, (2 * S, *row))
    arrays["hidden"].resize((2 * S, *row))
    arrays["hidden"][:] = x
    reads = DirectReads.of(arrays["hidden"], tmp_path / "hidden")
    obj = object_path(tmp_path, "hidden", row, 1)
    b = bytearray(obj.read_bytes())
    b[-1] ^= 0xFF  # the index's crc32c
    obj.write_bytes(bytes(b))
    out = np.empty((10, *row), dtype)
    with pytest.raises(ValueError, match="fails its checksum"):
        reads.read_into(S + 3, S + 13, out)
    object_path(tmp_path, "hidden", row, 0).unlink()
    reads.read_into(3, 13, out)  # as zarr reads a missing object: the fill value
    assert not out.any()
