"""The Zarr side of a shard writer: a shard's arrays, and the writes of whole objects to them.

Every array is token-major and uses the Zarr v3 sharding codec with one *object* (file) per `S` tokens,
holding inner chunks of a few MB.  `ObjectWrites` writes whole objects only, each exactly once, in one
contiguous slice per array, on I/O threads (Zarr, numpy and os.fsync only: no torch, no compiled code, no
masks) so that the caller goes on meanwhile; each write fsyncs its own objects right after writing them.
A failed write poisons the writer (dflash/store/writer.py says why that keeps commits honest).

Compression: zstd/blosc-zstd shrink bf16 hidden states only a little, and encode and decode them slower
than precompute produces them and training reads them, so `hidden` is stored uncompressed by default
(`hidden_compressor="zstd"` turns it on); ids, masks and top-k use blosc-zstd with byte shuffle.  Where
zarr has it, the arrays are written through zarr's FusedCodecPipeline (same bytes) rather than its default
pipeline, which encodes every object on zarr's one event-loop thread and then bounds the writer; with it
precompute's GPU does not wait for the store.  Write rates: benchmarks/precompute-qwen3-8b-h200-2026-11-30.md.
"""

from __future__ import annotations

import functools
import shutil
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import zarr
from zarr.codecs import BloscCodec, ZstdCodec
from zarr.storage import LocalStore

from dflash.durable import disk_full_error, is_disk_full
from dflash.errors import StoreError
from dflash.store.direct import DirectObjects
from dflash.store.rows import fsync_files

try:  # zarr >= 3.4
    from zarr.core.codec_pipeline import FusedCodecPipeline

    FUSED: str | None = f"{FusedCodecPipeline.__module__}.{FusedCodecPipeline.__qualname__}"
except ImportError:
    FUSED = None


def open_arrays(shard_dir: Path, specs: dict, attrs: dict, S: int, ci: int, hidden_compressor: str | None,
                fused: bool) -> dict[str, zarr.Array]:
    """The shard's arrays, made with objects of `S` tokens and inner chunks of `ci` (an existing shard keeps
    its own); `attrs` must match those the shard was made with."""
    # An array keeps the codec pipeline of the config in force when it is made (resize keeps it), and
    # zarr has no per-array setting for it.  The config is global, so arrays other threads happen to
    # open meanwhile get the fused pipeline too: it reads and writes the same bytes.
    with zarr.config.set({"codec_pipeline.path": FUSED} if fused and FUSED else {}):
        group = zarr.open_group(LocalStore(shard_dir), mode="a")
        if not group.attrs.get("hidden_dtype"):
            group.attrs.update(attrs)
        else:
            diffs = [f"{k}: shard has {group.attrs.get(k)!r}, writer has {v!r}" for k, v in attrs.items()
                     if group.attrs.get(k) != v]
            if diffs:
                raise StoreError(
                    f"{shard_dir} was written with other settings ({'; '.join(diffs)}); rerun with the "
                    "original settings or pass --overwrite to start over."
                )
        return {name: _open_array(group, name, dtype, row, attrs["hidden_dtype"], S, ci, hidden_compressor)
                for name, (dtype, row) in specs.items()}


def _open_array(group, name: str, dtype, row: tuple, hidden_dtype: str, S: int, ci: int, hidden_compressor):
    # every written object and inner chunk exists, all-zero ones too: simple cleanup and fsync, and the
    # bytes do not depend on the data.  A runtime setting, not stored: a resumed shard needs it again.
    keep_empty = {"write_empty_chunks": True}
    if name in group:
        return group[name].with_config(keep_empty)
    if name in ("hidden", "final_hidden"):  # the final hidden state is one more layer of hidden states
        chunks, comp = (ci, *row), (ZstdCodec(level=1) if hidden_compressor == "zstd" else None)
        extra = {"dtype": "bfloat16" if hidden_dtype == "bf16" else "float8_e4m3fn", "bits": str(dtype)}
        if hidden_dtype == "fp8":
            extra["scale"] = (f"{name}_scale [T, {'num_layers' if name == 'hidden' else 1}] float32 = amax/448; "
                              "value = e4m3 * scale")
    else:
        chunks, comp, extra = (S, *row), BloscCodec(cname="zstd", clevel=3, shuffle="shuffle"), {}
    return group.create_array(name=name, shape=(0, *row), dtype=dtype, chunks=chunks, shards=(S, *row),
                              compressors=comp, fill_value=0, attributes=extra, config=keep_empty)


def object_path(shard_dir: Path, name: str, row: tuple, k: int) -> Path:
    """The file of object `k` of array `name` (rows of shape `row`)."""
    p = shard_dir / name / "c" / str(k)
    return p / "0" if row else p


def remove_objects_from(shard_dir: Path, names, first: int) -> None:
    """Delete the objects `first`, `first` + 1, ... of every array: no commit refers to them."""
    for name in names:
        d = shard_dir / name / "c"
        for p in d.iterdir() if d.is_dir() else ():
            if p.name.isdigit() and int(p.name) >= first:
                shutil.rmtree(p) if p.is_dir() else p.unlink()


class ObjectWrites:
    """Writes of whole objects to `arrays`, up to `io_threads` in flight at once, each to objects no other
    write touches (io_threads 0: each written inline, on the caller's thread).  `on_written(lent)` gets a
    write's lent buffers back once it is done, on the caller's thread.

    A write of whole objects is cut into one task per object (every array's object k: `DirectObjects`
    encodes and writes them, then fsyncs them), so that a commit's objects are written side by side on the
    I/O threads; arrays `DirectObjects` does not handle, and the final partial object, go through zarr.
    `stage_s` sums the seconds spent per stage, over all threads (status.json's `writer_s`)."""

    def __init__(self, arrays: dict[str, zarr.Array], shard_dir: Path, io_threads: int, durable: bool, on_written,
                 S: int, direct: bool = True):
        self.arrays, self.dir, self.durable, self._on_written, self.S = arrays, shard_dir, durable, on_written, S
        self.max_inflight = max(0, int(io_threads))
        self._io = ThreadPoolExecutor(self.max_inflight, thread_name_prefix="dflash-store-io") if self.max_inflight else None
        self._inflight: deque = deque()  # ([futures], {array: lent buffer}), oldest first
        self.failed: BaseException | None = None
        self._direct = {n: d for n, a in arrays.items() if direct and (d := DirectObjects.of(a)) is not None}
        self.stage_s: dict[str, float] = {}
        self._lock = threading.Lock()

    def add_time(self, stage: str, seconds: float) -> None:
        with self._lock:
            self.stage_s[stage] = self.stage_s.get(stage, 0.0) + seconds

    def check_ok(self) -> None:
        if self.failed is not None:
            e = self.failed
            if isinstance(e, StoreError):  # already says where and what to do (a full disk)
                raise StoreError(str(e)) from e
            raise StoreError(
                f"{self.dir}: an earlier write failed ({type(e).__name__}: {e}), so nothing more is committed; "
                "fix the cause and rerun the same command to resume from the last commit."
            ) from e

    def make_room(self, final: bool) -> None:
        """Before a write: wait until it may start (a final one, which may shrink an array, waits for all)."""
        if final or self._io is None:
            self.drain()
            return
        self.reap(block=False)  # collect finished writes first, so that their buffers are reused
        while len(self._inflight) >= self.max_inflight:
            self.reap(block=True)

    def submit(self, lo: int, hi: int, slices: dict[str, np.ndarray], lent: dict, inline: bool = False) -> None:
        """Write tokens [lo, hi) of every array, on the I/O threads unless `inline` (a final write: [lo, hi)
        may end in a partial object)."""
        tasks = self._tasks(lo, hi, slices, whole=not inline)
        if self._io is not None and not inline:
            self._inflight.append(([self._io.submit(self._guarded, t) for t in tasks], lent))
            return
        try:
            for t in tasks:
                self._guarded(t)
        except BaseException as e:
            self.failed = e
            raise
        self._on_written(lent)

    def _tasks(self, lo: int, hi: int, slices: dict[str, np.ndarray], whole: bool) -> list:
        """Callables writing [lo, hi): one per object for the arrays written directly, one for the rest."""
        direct = self._direct if whole else {}
        tasks = [functools.partial(self._write_object, k, lo, slices) for k in range(lo // self.S, hi // self.S)
                 if direct]
        rest = [n for n in self.arrays if n not in direct]
        if rest:
            tasks.append(functools.partial(self._write_zarr, lo, hi, {n: slices[n] for n in rest}))
        return tasks

    def _guarded(self, task) -> None:
        """Run one write task; a full disk becomes a StoreError naming what was written."""
        try:
            task()
        except Exception as e:
            if is_disk_full(e):  # the objects are not committed: a rerun after freeing space rewrites them
                raise disk_full_error(self.dir, e) from e
            raise

    def _write_object(self, k: int, lo: int, slices: dict[str, np.ndarray]) -> None:
        """On an I/O thread: object k of every directly written array (numpy + os only), then its fsync."""
        t0 = time.perf_counter()
        paths = []
        for name, enc in self._direct.items():
            a = slices[name][k * self.S - lo : (k + 1) * self.S - lo]
            paths.append(object_path(self.dir, name, a.shape[1:], k))
            enc.write(paths[-1], a)
        t1 = time.perf_counter()
        if self.durable:
            fsync_files(paths)
        self.add_time("objects", t1 - t0)
        self.add_time("objects_fsync", time.perf_counter() - t1)

    def _write_zarr(self, lo: int, hi: int, slices: dict[str, np.ndarray]) -> None:
        """Tokens [lo, hi) of `slices`' arrays through zarr (numpy + zarr), then an fsync of their objects."""
        t0 = time.perf_counter()
        for name, a in slices.items():
            self.arrays[name][lo:hi] = a
        t1 = time.perf_counter()
        if self.durable:
            fsync_files([object_path(self.dir, n, a.shape[1:], k) for n, a in slices.items()
                         for k in range(lo // self.S, (hi - 1) // self.S + 1)])
        self.add_time("objects_zarr", t1 - t0)
        self.add_time("objects_fsync", time.perf_counter() - t1)

    def reap(self, block: bool) -> None:
        """Collect finished writes (with block, at least the oldest); a failed one poisons the writer."""
        t0 = time.perf_counter()
        while self._inflight and (block or all(f.done() for f in self._inflight[0][0])):
            futures, lent = self._inflight.popleft()
            block = False
            try:
                for f in futures:
                    f.result()  # re-raises a failed write here, before any commit can refer to it
            except BaseException as e:
                self.failed = e
                raise
            self._on_written(lent)
        self.add_time("wait_writes", time.perf_counter() - t0)

    def drain(self) -> None:
        while self._inflight:
            self.reap(block=True)

    def shutdown(self) -> None:
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None
