"""ShardWriter: appends samples to one shard of a store, crash-safely.

Commit protocol
---------------
Every array of a shard is token-major and uses the Zarr v3 sharding codec with one *object* (file) per
`S` tokens (`tokens_per_object`, all arrays alike), holding inner chunks of a few MB.  Zarr updates an
object by read-modify-write of the whole file (LocalStore replaces it via tmp + rename, other stores may
not), so a design that keeps appending into a half-filled object would rewrite committed bytes.  Instead:

1. Appends are copied into an in-memory buffer.  Only *whole* objects (`S` tokens starting at a
   multiple of `S`) are written to Zarr, each exactly once, in one big contiguous slice per array, on
   I/O threads (Zarr, numpy and os.fsync only) so that the caller goes on meanwhile; up to `io_threads`
   writes are in flight, each to *other* objects, and each fsyncs its own objects right after writing
   them.  Array resizes (metadata) happen only on the caller's thread, before the objects they cover are
   submitted, and only grow an array while writes are in flight.  A commit waits for every write.
2. `commit()` (every `commit_every_tokens` appended tokens, and on close/finalize) makes everything
   appended so far durable, in this order:
     a. write the whole objects still buffered and wait for every write in flight (objects are fsynced
        by their I/O thread); fsync the array metadata changed since the last commit;
     b. write the remainder (< S tokens, past the last whole object: the *tail*) to
        `tail-<end>.arrow` (Arrow IPC; tmp + fsync + os.replace);
     c. write the index segment `index/seg-<n>.arrow` for the samples appended since the last commit,
        its metadata naming the committed token `end` and `zarr_end` (tokens below it are in Zarr);
        tmp + fsync + os.replace.  This rename *is* the commit point;
     d. delete the previous tail file.
   Committed Zarr objects are never written again; the committed tail lives in an immutable file.
3. On open, the writer loads the committed state (segments 0..n, or index.arrow when finished), deletes
   whatever no commit refers to (Zarr objects at or past `zarr_end`, other tail files, tmp/.partial
   files), reloads the tail into its buffer and continues at `end`.  Because token offsets are a pure
   function of the sample order (no gaps) and objects are cut at fixed multiples of `S`, a rerun after
   `kill -9` at any instant rewrites exactly the bytes an uninterrupted run writes.
4. `finalize()` commits, resizes the arrays to the exact token count, writes the last (partial) object,
   fsyncs, writes the consolidated `index.arrow` (atomic: from here on the shard is complete), removes
   the segments and the tail, and marks the shard complete in its status file.

Readers trust only the committed index (layout.load_committed) and never look past `end`.  A failed
object write poisons the writer: it re-raises the error, and every later call raises StoreError instead of
committing anything that might refer to the missing object.

Compression: zstd/blosc-zstd shrink bf16 hidden states only a little, and encode and decode them slower
than precompute produces them and training reads them, so `hidden` is stored uncompressed by default
(`hidden_compressor="zstd"` turns it on); ids, masks and top-k use blosc-zstd with byte shuffle.
Checksums are xxh3-64, cheap next to the writes, one per sample per array.  Local filesystems only
(fsync).  Where zarr has it, the arrays are written through zarr's FusedCodecPipeline (`fused_pipeline`,
same bytes) rather than its default pipeline, which encodes every object on zarr's one event-loop
thread and then bounds the writer; with it precompute's GPU does not wait for the store.  Write rates
are in docs/BENCHMARKS.md.
`dflash.store.pipeline.WritePipeline` runs a ShardWriter on a thread of its own so that precompute's GPU
never waits for it.
"""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import zarr
from zarr.codecs import BloscCodec, ZstdCodec
from zarr.storage import LocalStore

from dflash.errors import StoreError
from dflash.store import layout
from dflash.store.manifest import (
    atomic_write_bytes,
    disk_full_error,
    is_disk_full,
    mark_shard,
    shard_name,
    shard_status,
)
from dflash.store.rows import FP8_MAX, Rows, as_stored, encode_hidden, encode_hidden_tensors, fsync_files, pow2_floor

__all__ = ["FP8_MAX", "ShardWriter", "encode_hidden", "encode_hidden_tensors"]


try:  # zarr >= 3.4
    from zarr.core.codec_pipeline import FusedCodecPipeline

    _FUSED: str | None = f"{FusedCodecPipeline.__module__}.{FusedCodecPipeline.__qualname__}"
except ImportError:
    _FUSED = None


def _disk_full_named(fn):
    """A full disk hit anywhere in `fn` (array metadata, tails, index segments) as a StoreError naming the
    shard and what to do; writes of objects name the object themselves (_store_slices)."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except StoreError:
            raise
        except Exception as e:
            if is_disk_full(e):
                raise disk_full_error(self.dir, e) from e
            raise

    return wrapper


def _in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


class ShardWriter:
    """Append samples to `STORE/shard-<shard_index>`; exactly one process may hold a given shard."""

    def __init__(
        self,
        store_path: str | os.PathLike,
        shard_index: int,
        *,
        hidden_width: int,
        num_layers: int,
        hidden_dtype: str = "bf16",
        topk: int = 0,
        commit_every_tokens: int = 32768,
        chunk_tokens: int | None = None,  # inner chunk (default: ~4 MB of hidden states)
        chunks_per_object: int = 16,  # inner chunks per Zarr shard object (file)
        hidden_compressor: str | None = None,  # None | "zstd"
        flush_tokens: int | None = None,  # write whole objects once this many tokens are buffered
        durable: bool = True,  # fsync at commits (power-loss safety); kill -9 safety holds either way
        overlap_io: bool = True,  # write Zarr objects on I/O threads (False: inline, on the caller's thread)
        io_threads: int = 4,  # object writes in flight at once, each on its own thread, to other objects
        # (4 rather than 2: precompute of an 8B target ran faster with 4; docs/BENCHMARKS.md)
        # encode objects on the I/O threads, each with its own event loop, instead of through zarr's synchronous
        # API (one event-loop thread for all); no gain measured (CPU only), and zarr >= 3.4's fused pipeline (below)
        # takes the encoding off that thread anyway
        own_event_loops: bool = False,
        # zarr >= 3.4 only (ignored before): build the arrays on zarr's FusedCodecPipeline, which writes the
        # objects of a slice in parallel on worker threads, off zarr's event-loop thread; same bytes
        fused_pipeline: bool = True,
    ):
        self._own_loops = own_event_loops
        self._fused = fused_pipeline and _FUSED is not None
        self.durable = durable
        # I/O threads so that disk writes overlap the caller's work.  They only ever see numpy arrays, zarr
        # and os.fsync (_store_slices): no torch, no compiled code, no masks.
        n_io = max(1, int(io_threads)) if overlap_io else 0
        self._io = ThreadPoolExecutor(n_io, thread_name_prefix="dflash-store-io") if n_io else None
        self._max_inflight = n_io
        self._inflight: deque = deque()  # (future, {array: lent buffer}), oldest first
        self._failed: BaseException | None = None
        self._aborted = False
        self.root = Path(store_path)
        self.shard = int(shard_index)
        self.dir = self.root / shard_name(self.shard)
        self.hidden_dtype, self.num_layers, self.topk = hidden_dtype, int(num_layers), int(topk)
        if hidden_width % num_layers:
            raise ValueError(f"hidden_width {hidden_width} is not a multiple of num_layers {num_layers}")
        self.specs = layout.array_specs(hidden_dtype, int(hidden_width), self.num_layers, self.topk)
        self.commit_every_tokens = int(commit_every_tokens)
        row_bytes = hidden_width * self.specs["hidden"][0].itemsize
        ci = chunk_tokens or min(8192, max(16, pow2_floor(4 * 2**20 / row_bytes)))
        self.arrays = self._open_arrays(ci * chunks_per_object, ci, hidden_compressor)
        self.S = self.arrays["hidden"].shards[0]  # an existing shard keeps the object size it was made with

        c = layout.load_committed(self.dir, self.specs)
        self._committed = c
        self.complete = c.complete
        self._ids = set(c.index.column("sample_id").to_pylist())
        self._rows = set(c.index.column("source_row").to_pylist())
        self._cleanup(c)
        # bounded memory between commits: write whole objects every ~256 MB of hidden states
        self._flush_tokens = flush_tokens or self.S * max(1, (256 * 2**20) // (self.S * row_bytes))
        # buffer: token rows [_buf_start, _buf_start + _buffered) not yet in whole Zarr objects
        cap = self._flush_tokens + self.S
        self._buf = {n: Rows(dtype, row, cap) for n, (dtype, row) in self.specs.items()}
        self._buf_start, self._buffered = c.zarr_end, c.end - c.zarr_end
        if c.tail is not None:
            for n, a in layout.tail_arrays(layout.read_ipc(c.tail)).items():
                self._buf[n].append(a)
        self._pending: list[dict] = []
        self._pending_ids: set[int] = set()
        self._since_commit = 0
        self._unsynced: set[Path] = set()
        if not self.complete and shard_status(self.root, self.shard).get("status") != "running":
            mark_shard(self.root, self.shard, "running")

    # -- set-up -------------------------------------------------------------------------------------

    def _open_arrays(self, S: int, ci: int, hidden_compressor) -> dict[str, zarr.Array]:
        # An array keeps the codec pipeline of the config in force when it is made (resize keeps it), and
        # zarr has no per-array setting for it.  The config is global, so arrays other threads happen to
        # open meanwhile get the fused pipeline too: it reads and writes the same bytes.
        with zarr.config.set({"codec_pipeline.path": _FUSED} if self._fused else {}):
            return self._open_arrays_now(S, ci, hidden_compressor)

    def _open_arrays_now(self, S: int, ci: int, hidden_compressor) -> dict[str, zarr.Array]:
        group = zarr.open_group(LocalStore(self.dir), mode="a")
        attrs = {
            "hidden_width": self.specs["hidden"][1][0],
            "num_layers": self.num_layers,
            "hidden_dtype": self.hidden_dtype,
            "topk": self.topk,
            "checksum": layout.CHECKSUM,
        }
        if not group.attrs.get("hidden_dtype"):
            group.attrs.update(attrs)
        else:
            diffs = [f"{k}: shard has {group.attrs.get(k)!r}, writer has {v!r}" for k, v in attrs.items() if group.attrs.get(k) != v]
            if diffs:
                raise StoreError(
                    f"{self.dir} was written with other settings ({'; '.join(diffs)}); rerun with the "
                    "original settings or pass --overwrite to start over."
                )
        small = BloscCodec(cname="zstd", clevel=3, shuffle="shuffle")
        # every written object and inner chunk exists, all-zero ones too: simple cleanup and fsync, and the
        # bytes do not depend on the data.  A runtime setting, not stored: a resumed shard needs it again.
        keep_empty = {"write_empty_chunks": True}
        arrays = {}
        for name, (dtype, row) in self.specs.items():
            if name in group:
                arrays[name] = group[name].with_config(keep_empty)
                continue
            if name == "hidden":
                chunks, comp = (ci, *row), (ZstdCodec(level=1) if hidden_compressor == "zstd" else None)
                dt_attr = "bfloat16" if self.hidden_dtype == "bf16" else "float8_e4m3fn"
                extra = {"dtype": dt_attr, "bits": str(dtype)}
                if self.hidden_dtype == "fp8":
                    extra["scale"] = "hidden_scale [T, num_layers] float32 = amax/448; value = e4m3 * scale"
            else:
                chunks, comp, extra = (S, *row), small, {}
            arrays[name] = group.create_array(
                name=name,
                shape=(0, *row),
                dtype=dtype,
                chunks=chunks,
                shards=(S, *row),
                compressors=comp,
                fill_value=0,
                attributes=extra,
                config=keep_empty,
            )
        return arrays

    def _object_dir(self, name: str) -> Path:
        return self.dir / name / "c"

    def _object_path(self, name: str, k: int) -> Path:
        p = self._object_dir(name) / str(k)
        return p / "0" if self.specs[name][1] else p

    def _cleanup(self, c: layout.Committed) -> None:
        for p in layout.stale_files(self.dir, c):
            p.unlink(missing_ok=True)
        if c.complete:
            if (self.dir / layout.SEGMENTS).is_dir():
                shutil.rmtree(self.dir / layout.SEGMENTS, ignore_errors=True)
            return
        first_stale = c.zarr_end // self.S  # objects from here on were never committed
        for name in self.specs:
            d = self._object_dir(name)
            for p in d.iterdir() if d.is_dir() else ():
                if p.name.isdigit() and int(p.name) >= first_stale:
                    shutil.rmtree(p) if p.is_dir() else p.unlink()

    # -- queries ------------------------------------------------------------------------------------

    def committed_sample_ids(self) -> set[int]:
        return set(self._ids)

    def committed_source_rows(self) -> set[int]:
        return set(self._rows)

    @property
    def num_tokens(self) -> int:
        """Tokens appended so far (committed or not)."""
        return self._buf_start + self._buffered

    # -- writing ------------------------------------------------------------------------------------

    def _check_ok(self) -> None:
        if self._failed is not None:
            e = self._failed
            if isinstance(e, StoreError):  # already says where and what to do (a full disk)
                raise StoreError(str(e)) from e
            raise StoreError(
                f"{self.dir}: an earlier write failed ({type(e).__name__}: {e}), so nothing more is committed; "
                "fix the cause and rerun the same command to resume from the last commit."
            ) from e

    def append(self, sample_id, source_row, input_ids, loss_mask, hidden, topk_ids=None, topk_logprobs=None) -> None:
        self._check_new(sample_id)
        arrays = encode_hidden(hidden, self.hidden_dtype, self.num_layers)
        if self.topk:
            arrays["topk_ids"], arrays["topk_logprobs"] = topk_ids, topk_logprobs
        self.append_encoded(sample_id, source_row, input_ids, loss_mask, arrays)

    def _check_new(self, sample_id) -> int:
        if self.complete:
            raise StoreError(f"{self.dir} is complete (finalized); nothing can be appended to it.")
        self._check_ok()
        if self._aborted:
            raise StoreError(f"{self.dir}: this writer was closed or aborted; open a new one to append.")
        sid = int(sample_id)
        if sid in self._ids or sid in self._pending_ids:
            raise ValueError(f"sample {sid} is already in {self.dir}")
        return sid

    @_disk_full_named
    def append_encoded(self, sample_id, source_row, input_ids, loss_mask, arrays: dict) -> None:
        """append() for rows already in stored form (`encode_hidden_tensors`): `arrays` holds `hidden`
        (bf16 bits as int16/uint16, or e4m3 bits as uint8), `hidden_scale` (fp8), `topk_ids`,
        `topk_logprobs` ([T, ...] numpy arrays or CPU tensors).  Everything is copied before it returns."""
        sid = self._check_new(sample_id)
        rows = {"input_ids": as_stored(input_ids, self.specs["input_ids"][0]).reshape(-1),
                "loss_mask": as_stored(loss_mask, self.specs["loss_mask"][0]).reshape(-1)}
        t = len(rows["input_ids"])
        if t == 0:
            raise ValueError(f"sample {sid} has no tokens")
        for name, (dtype, row) in self.specs.items():
            if name not in rows:
                if arrays.get(name) is None:
                    raise ValueError(f"sample {sid}: {name} is missing")
                rows[name] = as_stored(arrays[name], dtype)
            if rows[name].shape != (t, *row):
                raise ValueError(f"sample {sid}: {name} has shape {rows[name].shape}, expected {(t, *row)}")
        entry = {
            "sample_id": sid,
            "source_row": int(source_row),
            "offset": self.num_tokens,
            "length": t,
            "num_supervised": int(np.count_nonzero(rows["loss_mask"])),
        }
        for name in self.specs:
            entry[f"checksum_{name}"] = layout.checksum(rows[name])
            self._buf[name].append(rows[name])
        self._pending.append(entry)
        self._pending_ids.add(sid)
        self._buffered += t
        self._since_commit += t
        if self._since_commit >= self.commit_every_tokens:
            self.commit()
        elif self._buffered >= self._flush_tokens:
            self._write_objects()

    def _write_objects(self, final: bool = False) -> None:
        """Write the buffered whole objects (or, when final, everything) to Zarr, one slice per array.

        The write runs on an I/O thread while the caller goes on; up to `io_threads` writes are in flight
        (each to objects no other write touches), and commit() waits for all of them before anything
        refers to their objects.  Resizes happen here, on the caller's thread, before the write that
        needs them is submitted; while writes are in flight they only grow an array (metadata only).
        """
        self._check_ok()
        n = self._buffered if final else (self._buffered // self.S) * self.S
        if n == 0:
            return
        if final or self._io is None:
            self._drain_io()  # a final resize may shrink an array (a killed run left it larger)
        else:  # collect finished writes first, so that their buffers are reused by take() below
            self._reap(block=False)
            while len(self._inflight) >= self._max_inflight:
                self._reap(block=True)
        lo, hi = self._buf_start, self._buf_start + n
        objects, slices, lent = [], {}, {}
        for name, arr in self.arrays.items():
            if arr.shape[0] < hi or (final and arr.shape[0] != hi):
                arr.resize((hi, *arr.shape[1:]))
                self._unsynced.add(self.dir / name / "zarr.json")
            slices[name], lent[name] = self._buf[name].take(n)  # not touched again until given back
            objects += [self._object_path(name, k) for k in range(lo // self.S, (hi - 1) // self.S + 1)]
        self._buf_start, self._buffered = hi, self._buffered - n
        if self._io is None or final:
            try:
                self._store_slices(lo, hi, slices, objects)
            except BaseException as e:
                self._failed = e
                raise
            self._give_back(lent)
            return
        self._inflight.append((self._io.submit(self._store_slices, lo, hi, slices, objects), lent))

    def _store_slices(self, lo: int, hi: int, slices: dict[str, np.ndarray], objects: list[Path]) -> None:
        """On an I/O thread: write whole objects (numpy + zarr), then fsync them and their directories.

        zarr's default pipeline encodes (copies the inner chunks, joins them into the object) on zarr's
        one event-loop thread, where the I/O threads' encodings queue up behind each other.  The fused
        pipeline (zarr >= 3.4, `fused_pipeline`) encodes and stores each object of the slice on a worker
        thread instead; own_event_loops runs the default pipeline's encoding on this thread, through zarr's
        async API on an event loop of its own (bench/zarr_encode.py; docs/BENCHMARKS.md)."""
        async def write_all():
            await asyncio.gather(*(arr.async_array.setitem(slice(lo, hi), slices[name]) for name, arr in self.arrays.items()))

        try:
            if self._own_loops and not _in_event_loop():  # asyncio.run needs a thread without a running loop
                asyncio.run(write_all())
            else:  # zarr's synchronous API, which runs on zarr's own loop
                for name, arr in self.arrays.items():
                    arr[lo:hi] = slices[name]
            if self.durable:
                fsync_files(objects)
        except Exception as e:
            if is_disk_full(e):  # the objects are not committed: a rerun after freeing space rewrites them
                raise disk_full_error(objects[0] if objects else self.dir, e) from e
            raise

    def _give_back(self, lent: dict[str, np.ndarray]) -> None:
        for name, buf in lent.items():
            self._buf[name].give_back(buf)

    def _reap(self, block: bool) -> None:
        """Collect finished writes (with block, at least the oldest); a failed one poisons the writer."""
        while self._inflight and (block or self._inflight[0][0].done()):
            f, lent = self._inflight.popleft()
            block = False
            try:
                f.result()  # re-raises a failed write here, before any commit can refer to it
            except BaseException as e:
                self._failed = e
                raise
            self._give_back(lent)

    def _drain_io(self) -> None:
        while self._inflight:
            self._reap(block=True)

    def _sync(self) -> None:
        """fsync what changed since the last commit besides the objects (their I/O thread synced them)."""
        if not self.durable:
            self._unsynced.clear()
            return
        fsync_files(self._unsynced)
        self._unsynced.clear()

    @_disk_full_named
    def commit(self) -> None:
        """Make every appended sample durable and visible to readers (see the module docstring)."""
        if not self._pending:
            return
        self._check_ok()
        self._write_objects()
        self._drain_io()
        self._sync()
        end = self.num_tokens
        if self._buffered:
            tail = layout.tail_table({n: self._buf[n].view() for n in self.specs}, self._buf_start, end)
            atomic_write_bytes(layout.tail_path(self.dir, end), layout.to_ipc_bytes(tail), self.durable)
        seg = pa.Table.from_pylist(self._pending, schema=layout.index_schema(self.specs))
        seg = layout.with_meta(seg, end=end, zarr_end=self._buf_start)
        n = self._committed.num_segments
        (self.dir / layout.SEGMENTS).mkdir(exist_ok=True)
        atomic_write_bytes(layout.seg_path(self.dir, n), layout.to_ipc_bytes(seg), self.durable)  # commit point
        if self._committed.tail is not None and self._committed.tail != layout.tail_path(self.dir, end):
            self._committed.tail.unlink(missing_ok=True)
        self._committed = layout.Committed(
            pa.concat_tables([self._committed.index, seg.replace_schema_metadata(None)]),
            end,
            self._buf_start,
            layout.tail_path(self.dir, end) if self._buffered else None,
            False,
            n + 1,
        )
        self._ids |= self._pending_ids
        self._rows |= {e["source_row"] for e in self._pending}
        self._pending, self._pending_ids, self._since_commit = [], set(), 0

    @_disk_full_named
    def finalize(self, stats: dict | None = None) -> None:
        """Commit, write the last object and the consolidated index, and mark the shard complete."""
        if not self.complete:
            self._check_ok()
            self.commit()
            end = self.num_tokens
            self._write_objects(final=True)
            for name, arr in self.arrays.items():
                if arr.shape[0] != end:  # nothing was buffered, or a killed run left a larger shape
                    arr.resize((end, *arr.shape[1:]))
                    self._unsynced.add(self.dir / name / "zarr.json")
            self._sync()
            # one record batch: the file's bytes do not depend on how many commits built it
            index = layout.with_meta(self._committed.index.combine_chunks(), end=end, zarr_end=end)
            atomic_write_bytes(self.dir / layout.INDEX, layout.to_ipc_bytes(index), self.durable)  # complete
            self.complete = True
            self._committed = layout.load_committed(self.dir, self.specs)
            self._cleanup(self._committed)
        idx = self._committed.index
        mark_shard(
            self.root,
            self.shard,
            "complete",
            {
                "num_samples": idx.num_rows,
                "num_tokens": self._committed.end,
                "num_supervised": int(np.sum(idx.column("num_supervised").to_numpy())),
                **(stats or {}),
            },
        )

    def close(self) -> None:
        """Commit what was appended (unless a write failed), then stop the I/O threads."""
        try:
            if not self.complete and self._failed is None and not self._aborted:
                self.commit()
        finally:
            self.abort()

    def abort(self) -> None:
        """Stop the I/O threads without committing anything more (what was committed stays)."""
        self._aborted = True
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
