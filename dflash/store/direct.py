"""Whole Zarr shard objects encoded and written by the writer itself: the bytes zarr writes, in fewer passes.

Why: zarr (3.1) writes even a whole, aligned shard object through its partial-write path, on its one
event-loop thread: it fills every inner chunk with the fill value, copies the data in, encodes, then
concatenates the chunks into one buffer before the file write.  That is four passes over the data on one
thread, and with small rows (a 135M target stores 3.5 KB per token) it bounds precompute below the
capture's rate.  Here an object is encoded chunk by chunk straight from the writer's
buffer (raw chunks are views, compressed ones go through the same numcodecs codec zarr uses) and written with
one `writev`, on the caller's I/O thread, so objects are written in parallel and the GIL is released for
the copies, the compression and the write.

Only the codec chains `objects.open_arrays` makes are handled (the sharding codec with its index at the end,
bytes + crc32c index codecs, inner `bytes` then at most one of blosc / zstd); `DirectObjects.of` returns
None for anything else and the writer keeps using zarr for that array.  tests/store/test_direct.py
checks that every array a shard stores gets byte for byte the objects zarr writes, and reads them back
through zarr.  Objects are written in place (no temporary and rename, unlike zarr's LocalStore): the
writer writes an object only past its last commit's `zarr_end` and fsyncs it before a commit refers to
it, and a reopened writer deletes every object at or past `zarr_end`, so a torn object is never read.
"""

from __future__ import annotations

import os
import struct
import sys
from collections import OrderedDict
from pathlib import Path

import google_crc32c
import numcodecs
import numpy as np
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, ShardingCodec, ZstdCodec
from zarr.codecs.sharding import ShardingCodecIndexLocation

_SHUFFLE = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}
IOV_MAX = 1024  # writev's limit on buffers per call (Linux); an object here has a few dozen


class DirectObjects:
    """Encoder and writer of whole objects (`S` token rows) of one zarr array."""

    def __init__(self, dtype: np.dtype, S: int, ci: int, compressor):
        self.dtype, self.S, self.ci, self.compressor = dtype, S, ci, compressor

    @classmethod
    def of(cls, arr) -> DirectObjects | None:
        """The encoder of `arr`'s objects, or None when its codecs are not ones this module writes."""
        codecs = arr.metadata.codecs
        if len(codecs) != 1 or not isinstance(codecs[0], ShardingCodec):
            return None
        sc = codecs[0]
        if sc.index_location != ShardingCodecIndexLocation.end or not _plain_index(sc.index_codecs):
            return None
        dtype = np.dtype(arr.dtype)
        shard, inner = tuple(arr.metadata.chunk_grid.chunk_shape), tuple(sc.chunk_shape)
        if shard[1:] != inner[1:] or shard[0] % inner[0] or dtype.kind not in "iuf":
            return None
        first, *rest = sc.codecs
        if not isinstance(first, BytesCodec) or len(rest) > 1:
            return None
        if dtype.itemsize > 1 and (first.endian is None or _value(first.endian) != sys.byteorder):
            return None
        compressor = _compressor(rest[0]) if rest else None
        if rest and compressor is None:
            return None
        return cls(dtype, shard[0], inner[0], compressor)

    def encode(self, rows: np.ndarray) -> list:
        """One object's `S` rows -> its bytes as a list of buffers: the inner chunks, then the index."""
        if rows.shape[0] != self.S or rows.dtype != self.dtype:
            raise ValueError(f"an object holds {self.S} rows of {self.dtype}, got {rows.shape[0]} of {rows.dtype}")
        rows = np.ascontiguousarray(rows)
        n = self.S // self.ci
        parts, index, pos = [], np.empty((n, 2), dtype="<u8"), 0
        for j in range(n):
            raw = rows[j * self.ci : (j + 1) * self.ci].reshape(-1).view(np.uint8)
            b = memoryview(self.compressor.encode(raw) if self.compressor is not None else raw).cast("B")
            parts.append(b)
            index[j] = (pos, b.nbytes)
            pos += b.nbytes
        ib = index.tobytes()
        parts.append(ib + struct.pack("<I", google_crc32c.value(ib)))
        return parts

    def write(self, path: Path, rows: np.ndarray) -> None:
        """Write one object's file (its directory made if needed); the caller fsyncs it."""
        parts = self.encode(rows)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            total = sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in parts)
            done = 0
            while done < total:  # writev may write less than asked (large buffers, signals)
                done += os.writev(fd, _from(parts, done)[:IOV_MAX])
        finally:
            os.close(fd)


class DirectReads:
    """Rows of one array read straight from its objects' inner chunks with `pread`.

    Why: zarr reads a row range by decoding every inner chunk it touches whole (1,024 rows of a 135M
    target's hidden states, or a whole object of 16K token ids, for a sample of a few hundred tokens) on
    its event-loop thread, one round trip per read, and the training loader's workers wait on it.  A raw
    inner chunk (the `bytes` codec alone) is the rows
    themselves, so a range is a few `preadv`s into the caller's buffer; a compressed one is read and
    decoded once and kept in a small cache, since the samples of a micro-batch share objects.  Objects are
    immutable once a commit refers to them, so each one's index is read once."""

    CACHE_BYTES = 64 * 2**20  # decoded compressed chunks kept per array (token ids, masks, top-k: small)

    def __init__(self, array_dir: Path, S: int, ci: int, dtype: np.dtype, row: tuple, compressor=None):
        self.dir, self.S, self.ci, self.dtype, self.row, self.compressor = array_dir, S, ci, dtype, row, compressor
        self.row_bytes = dtype.itemsize * int(np.prod(row, dtype=np.int64))
        self._index: dict[int, np.ndarray] = {}
        self._decoded: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    @classmethod
    def of(cls, arr, array_dir: Path) -> DirectReads | None:
        """The reader of `arr` (stored in `array_dir`), or None for codecs this module does not write."""
        enc = DirectObjects.of(arr)
        return None if enc is None else cls(array_dir, enc.S, enc.ci, enc.dtype, tuple(arr.shape[1:]), enc.compressor)

    def _object(self, k: int) -> Path:
        p = self.dir / "c" / str(k)
        return p / "0" if self.row else p

    def _chunks(self, k: int, fd: int) -> np.ndarray:
        """Object k's index: [inner chunks, 2] (offset, nbytes; -1 for a chunk past the array's end, which
        a partial last object leaves out), its checksum checked."""
        idx = self._index.get(k)
        if idx is not None:
            return idx
        n = self.S // self.ci
        data = os.fstat(fd).st_size - n * 16 - 4
        raw = os.pread(fd, n * 16 + 4, max(data, 0))
        if len(raw) != n * 16 + 4 or google_crc32c.value(raw[:-4]) != struct.unpack("<I", raw[-4:])[0]:
            raise ValueError(f"object {self._object(k)}: its shard index fails its checksum")
        idx = np.frombuffer(raw[:-4], dtype="<u8").reshape(n, 2).astype(np.int64)
        present = idx[:, 0] >= 0
        raw_size = self.compressor is None and (idx[present, 1] != self.ci * self.row_bytes).any()
        if raw_size or (idx[present].sum(axis=1) > data).any():
            raise ValueError(f"object {self._object(k)}: its index names chunks outside the file or of the wrong size")
        self._index[k] = idx
        return idx

    def _decode(self, k: int, c: int, fd: int, idx: np.ndarray) -> np.ndarray:
        """Inner chunk c of object k, decoded: [ci * row_bytes] bytes, from the cache when it is there."""
        got = self._decoded.get((k, c))
        if got is not None:
            self._decoded.move_to_end((k, c))
            return got
        raw = os.pread(fd, int(idx[c, 1]), int(idx[c, 0]))
        try:
            got = np.frombuffer(self.compressor.decode(raw), dtype=np.uint8)
        except Exception as e:  # a garbled chunk: codecs raise many types (blosc: RuntimeError), never a StoreError
            raise ValueError(f"object {self._object(k)}: inner chunk {c} cannot be decompressed "
                             f"({type(e).__name__}: {e})") from e
        if got.size != self.ci * self.row_bytes:
            raise ValueError(f"object {self._object(k)}: inner chunk {c} decodes to {got.size} bytes, not "
                             f"{self.ci * self.row_bytes}")
        self._decoded[(k, c)] = got
        while len(self._decoded) > 1 and len(self._decoded) * got.size > self.CACHE_BYTES:
            self._decoded.popitem(last=False)
        return got

    def read_into(self, lo: int, hi: int, out: np.ndarray) -> None:
        """Rows [lo, hi) into `out` (C-contiguous, hi - lo rows of this array's dtype and row shape)."""
        if out.dtype.itemsize * out[:1].size != self.row_bytes or not out.flags.c_contiguous:
            raise ValueError(f"out of {out.dtype} {out.shape} does not hold rows of {self.row_bytes} bytes")
        buf = memoryview(out.reshape(-1).view(np.uint8))
        r = lo
        while r < hi:
            k = r // self.S
            end = min(hi, (k + 1) * self.S)
            try:
                fd = os.open(self._object(k), os.O_RDONLY)
            except FileNotFoundError:  # as zarr reads it: the fill value (0), which the checksums catch
                buf[(r - lo) * self.row_bytes : (end - lo) * self.row_bytes] = b"\0" * ((end - r) * self.row_bytes)
                r = end
                continue
            try:
                idx = self._chunks(k, fd)
                while r < end:
                    c, within = divmod(r - k * self.S, self.ci)
                    n = min(end - r, self.ci - within)
                    dst = buf[(r - lo) * self.row_bytes : (r - lo + n) * self.row_bytes]
                    if idx[c, 0] < 0:  # a chunk the index leaves out reads as the fill value too
                        dst[:] = b"\0" * len(dst)
                    elif self.compressor is not None:
                        dst[:] = self._decode(k, c, fd, idx)[within * self.row_bytes : (within + n) * self.row_bytes]
                    elif os.preadv(fd, [dst], int(idx[c, 0]) + within * self.row_bytes) != len(dst):
                        raise ValueError(f"object {self._object(k)} is shorter than its index says")
                    r += n
            finally:
                os.close(fd)


def _from(parts: list, skip: int) -> list:
    """`parts` less their first `skip` bytes."""
    out = []
    for p in parts:
        m = p if isinstance(p, memoryview) else memoryview(p)
        if skip >= m.nbytes:
            skip -= m.nbytes
            continue
        out.append(m[skip:])
        skip = 0
    return out


def _value(setting):
    """A codec setting's string: zarr 3.1 holds Enums (endian, cname, shuffle), zarr 3.4 their values."""
    return getattr(setting, "value", setting)


def _plain_index(index_codecs) -> bool:
    return (len(index_codecs) == 2 and isinstance(index_codecs[0], BytesCodec)
            and _value(index_codecs[0].endian) == "little"
            and isinstance(index_codecs[1], Crc32cCodec))


def _compressor(codec):
    """The numcodecs codec zarr encodes with for `codec` (a bytes-to-bytes codec), or None if not handled."""
    if isinstance(codec, BloscCodec) and codec.typesize is not None and codec.shuffle is not None:
        return numcodecs.Blosc(cname=_value(codec.cname), clevel=codec.clevel, shuffle=_SHUFFLE[_value(codec.shuffle)],
                               blocksize=codec.blocksize, typesize=codec.typesize)
    if isinstance(codec, ZstdCodec):
        return numcodecs.Zstd(level=codec.level, checksum=codec.checksum)
    return None
