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
2. `commit()` (once `commit_every_tokens` tokens were appended: where `S` <= that interval, at the first
   sample that ends at or past an object boundary, so that the tail is shorter than that sample; and on
   close/finalize) makes everything appended so far durable, in this order:
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

Checksums are xxh3-64, cheap next to the writes, one per sample per array.  Local filesystems only
(fsync).  The arrays and the object writes are dflash/store/objects.py; `dflash.store.pipeline.WritePipeline`
runs a ShardWriter on a thread of its own so that precompute's GPU never waits for it.
"""

from __future__ import annotations

import functools
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

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
from dflash.store.objects import ObjectWrites, open_arrays, remove_objects_from
from dflash.store.rows import (
    FP8_MAX,
    TokenBuffer,
    as_stored,
    encode_hidden,
    encode_hidden_tensors,
    final_named,
    fsync_files,
    pow2_floor,
)

__all__ = ["FP8_MAX", "ShardWriter", "encode_hidden", "encode_hidden_tensors"]


def _disk_full_named(fn):
    """A full disk hit anywhere in `fn` (array metadata, tails, index segments) as a StoreError naming the
    shard and what to do; writes of objects name the object themselves (objects.ObjectWrites)."""

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
        final_hidden: bool = False,  # store the target's last hidden state [T, H] too (layout.array_specs)
        commit_every_tokens: int = 262144,  # docs/DESIGN.md "Commit interval and start-up"
        chunk_tokens: int | None = None,  # inner chunk (default: ~4 MB of hidden states)
        chunks_per_object: int = 16,  # inner chunks per Zarr shard object (file)
        hidden_compressor: str | None = None,  # None | "zstd"
        flush_tokens: int | None = None,  # write whole objects once this many tokens are buffered
        durable: bool = True,  # fsync at commits (power-loss safety); kill -9 safety holds either way
        overlap_io: bool = True,  # write Zarr objects on I/O threads (False: inline, on the caller's thread)
        io_threads: int = 4,  # object writes in flight at once, each on its own thread, to other objects
        # (4 rather than 2: with 2, an 8B target's precompute waited on its writes)
        # zarr >= 3.4 only (ignored before): build the arrays on zarr's FusedCodecPipeline, which writes the
        # objects of a slice in parallel on worker threads, off zarr's event-loop thread; same bytes
        fused_pipeline: bool = True,
        # write whole objects with DirectObjects (zarr's bytes, without its codec pipeline: dflash/store/direct.py)
        direct_objects: bool = True,
    ):
        self.durable = durable
        self._aborted = False
        self.root = Path(store_path)
        self.shard = int(shard_index)
        self.dir = self.root / shard_name(self.shard)
        self.hidden_dtype, self.num_layers, self.topk = hidden_dtype, int(num_layers), int(topk)
        self.final_hidden = bool(final_hidden)
        if hidden_width % num_layers:
            raise ValueError(f"hidden_width {hidden_width} is not a multiple of num_layers {num_layers}")
        self.specs = layout.array_specs(hidden_dtype, int(hidden_width), self.num_layers, self.topk, self.final_hidden)
        self.commit_every_tokens = int(commit_every_tokens)
        row_bytes = hidden_width * self.specs["hidden"][0].itemsize
        ci = chunk_tokens or min(8192, max(16, pow2_floor(4 * 2**20 / row_bytes)))
        attrs = {"hidden_width": int(hidden_width), "num_layers": self.num_layers, "hidden_dtype": hidden_dtype,
                 "topk": self.topk, "checksum": layout.CHECKSUM, **({"final_hidden": True} if final_hidden else {})}
        self.arrays = open_arrays(self.dir, self.specs, attrs, ci * chunks_per_object, ci, hidden_compressor,
                                  fused_pipeline)
        self.S = self.arrays["hidden"].shards[0]  # an existing shard keeps the object size it was made with
        self._writes = ObjectWrites(self.arrays, self.dir, max(1, int(io_threads)) if overlap_io else 0,
                                    durable, self._give_back, self.S, direct_objects)

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
        self._buf = {n: TokenBuffer(dtype, row, cap) for n, (dtype, row) in self.specs.items()}
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

    def _cleanup(self, c: layout.Committed) -> None:
        for p in layout.stale_files(self.dir, c):
            p.unlink(missing_ok=True)
        if c.complete:
            if (self.dir / layout.SEGMENTS).is_dir():
                shutil.rmtree(self.dir / layout.SEGMENTS, ignore_errors=True)
            return
        remove_objects_from(self.dir, self.specs, c.zarr_end // self.S)

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

    def append(self, sample_id, source_row, input_ids, loss_mask, hidden, topk_ids=None, topk_logprobs=None,
               final_hidden=None) -> None:
        self._check_new(sample_id)
        arrays = encode_hidden(hidden, self.hidden_dtype, self.num_layers)
        if self.topk:
            arrays["topk_ids"], arrays["topk_logprobs"] = topk_ids, topk_logprobs
        if self.final_hidden and final_hidden is not None:
            arrays.update(final_named(encode_hidden(final_hidden, self.hidden_dtype, 1)))
        self.append_encoded(sample_id, source_row, input_ids, loss_mask, arrays)

    def _check_new(self, sample_id) -> int:
        if self.complete:
            raise StoreError(f"{self.dir} is complete (finalized); nothing can be appended to it.")
        self._writes.check_ok()
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
        `topk_logprobs`, `final_hidden` (+ `final_hidden_scale` for fp8) when the shard has it ([T, ...] numpy
        arrays or CPU tensors).  Everything is copied before it returns."""
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
        t0 = time.perf_counter()
        for name in self.specs:
            entry[f"checksum_{name}"] = layout.checksum(rows[name])
        t1 = time.perf_counter()
        for name in self.specs:
            self._buf[name].append(rows[name])
        self._writes.add_time("checksum", t1 - t0)
        self._writes.add_time("buffer_copy", time.perf_counter() - t1)
        self._pending.append(entry)
        self._pending_ids.add(sid)
        self._buffered += t
        self._since_commit += t
        # Once commit_every_tokens have passed, commit at the first sample that reaches an object boundary: the
        # tail file then holds less than that sample, not up to a whole object (~56 MB of a 135M target's rows
        # written again at every commit otherwise).  Only where objects are no longer than the commit interval,
        # so that the commit is late by less than one object; otherwise commit at once.
        due = self._since_commit >= self.commit_every_tokens
        if due and (self.S > self.commit_every_tokens or self.num_tokens % self.S < t):
            self.commit()
        elif self._buffered >= self._flush_tokens:
            self._write_objects()

    def _write_objects(self, final: bool = False) -> None:
        """Write the buffered whole objects (or, when final, everything) to Zarr, one slice per array.

        The write runs on an I/O thread while the caller goes on (a final one inline), and commit() waits
        for all of them before anything refers to their objects.  Resizes happen here, on the caller's
        thread, before the write that needs them is submitted; while writes are in flight they only grow
        an array (metadata only).
        """
        self._writes.check_ok()
        n = self._buffered if final else (self._buffered // self.S) * self.S
        if n == 0:
            return
        self._writes.make_room(final)  # a final resize may shrink an array (a killed run left it larger)
        lo, hi = self._buf_start, self._buf_start + n
        slices, lent = {}, {}
        for name, arr in self.arrays.items():
            if arr.shape[0] < hi or (final and arr.shape[0] != hi):
                arr.resize((hi, *arr.shape[1:]))
                self._unsynced.add(self.dir / name / "zarr.json")
            slices[name], lent[name] = self._buf[name].take(n)  # not touched again until given back
        self._buf_start, self._buffered = hi, self._buffered - n
        self._writes.submit(lo, hi, slices, lent, inline=final)

    def _give_back(self, lent: dict[str, np.ndarray]) -> None:
        for name, buf in lent.items():
            self._buf[name].give_back(buf)

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
        self._writes.check_ok()
        self._write_objects()
        self._writes.drain()
        t0 = time.perf_counter()
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
        self._writes.add_time("commit_files", time.perf_counter() - t0)
        self._writes.add_time("commits", 1)

    @_disk_full_named
    def finalize(self, stats: dict | None = None) -> None:
        """Commit, write the last object and the consolidated index, and mark the shard complete."""
        if not self.complete:
            self._writes.check_ok()
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
                **({"writer_s": self.stage_times()} if self._writes.stage_s else {}),
            },
        )

    def stage_times(self) -> dict[str, float]:
        """Seconds this writer spent per stage so far (I/O threads' stages summed over the threads):
        checksum, buffer_copy (into the writer's buffer), objects (encode + write of whole objects),
        objects_zarr (writes through zarr), objects_fsync, wait_writes (the caller waiting for object writes:
        room for one more, or a commit's), commit_files (metadata fsync, tail, index segment); `commits`
        counts the commits."""
        return {k: (int(v) if k == "commits" else round(v, 3)) for k, v in sorted(self._writes.stage_s.items())}

    def close(self) -> None:
        """Commit what was appended (unless a write failed), then stop the I/O threads."""
        try:
            if not self.complete and self._writes.failed is None and not self._aborted:
                self.commit()
        finally:
            self.abort()

    def abort(self) -> None:
        """Stop the I/O threads without committing anything more (what was committed stays)."""
        self._aborted = True
        self._writes.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
