"""ShardData: one shard's committed rows, read from its Zarr objects or its committed Arrow tail; and the
structural checks of a shard that both open_store and `dflash verify` make (docs/DESIGN.md §5)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import zarr
from zarr.storage import LocalStore

from dflash.errors import StoreError
from dflash.store import layout


class ShardData:
    """Token rows of one shard: Zarr arrays below `zarr_end`, the committed tail file above it."""

    def __init__(self, shard_dir: Path, committed: layout.Committed, array_names=()):
        self.dir = shard_dir
        self.end, self.zarr_end, self.tail_file = committed.end, committed.zarr_end, committed.tail
        self.array_names = tuple(array_names)
        self._arrays = None
        self._direct: dict = {}  # name -> DirectReads, or None where zarr must decode (compressed arrays)
        self._tail = None

    def __getstate__(self):
        return {**self.__dict__, "_arrays": None, "_direct": {}, "_tail": None}

    def _load_tail(self) -> None:
        """The committed rows past `zarr_end`.  A writer still at work replaces its tail file at every
        commit, the rows moving into whole Zarr objects or into the next tail (writer.py); a reader whose
        file is gone reloads the shard's committed state, where the same rows are, unchanged."""
        for _ in range(1000):
            table = layout.read_ipc(self.tail_file, missing_ok=True) if self.tail_file is not None else None
            if table is not None:
                self._tail = layout.tail_arrays(table)
                return
            c = layout.load_committed(self.dir, self.array_names)
            if c.end < self.end:
                raise StoreError(f"{self.dir}: the shard now ends at token {c.end}, before this reader's {self.end}; "
                                 "it was rewritten, not grown. Re-open the store (or restart training).")
            self.zarr_end, self.tail_file, self._arrays = c.zarr_end, c.tail, None  # reopen: the arrays grew
            self._direct = {}  # and read the objects' indexes afresh (a finalized shard's last one is new)
            if self.end <= self.zarr_end:
                return
        raise StoreError(f"{self.dir}: the tail file kept changing while it was read; is a writer committing "
                         "hundreds of times a second?")

    def _need_tail(self, hi: int) -> None:
        if hi > self.zarr_end and self._tail is None:
            self._load_tail()

    def array(self, name: str) -> zarr.Array:
        if self._arrays is None:
            try:
                self._arrays = zarr.open_group(LocalStore(self.dir, read_only=True), mode="r")
            except Exception as e:  # zarr raises several types for a missing/garbled group
                raise StoreError(f"{self.dir}: Zarr group cannot be opened ({e}); the shard is damaged.") from None
        try:
            return self._arrays[name]
        except Exception as e:  # KeyError when zarr.json is missing, others when it is garbled
            what = "is missing" if isinstance(e, KeyError) else f"cannot be read ({type(e).__name__}: {e})"
            raise StoreError(f"{self.dir / name / 'zarr.json'} (the metadata of array {name}) {what}; the shard "
                             "is damaged.") from None

    def _zarr_read(self, name: str, lo: int, hi: int, out=None):
        arr = self.array(name)
        try:
            if out is None:
                return arr[lo:hi]
            arr.get_basic_selection(slice(lo, hi), out=out)
        except Exception as e:  # a truncated or garbled object: zarr and its codecs raise many types
            raise StoreError(
                f"{self.dir}: rows [{lo}, {hi}) of {name} cannot be decoded ({type(e).__name__}: {e}); the shard "
                f"is damaged. Run `dflash verify {self.dir.parent}` to list the damaged samples, then re-run "
                "`dflash precompute` into a new store (another --out)."
            ) from e

    def _direct_reads(self, name: str):
        if name not in self._direct:
            from dflash.store.direct import DirectReads

            self._direct[name] = DirectReads.of(self.array(name), self.dir / name)
        return self._direct[name]

    def _object_read(self, name: str, lo: int, hi: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows [lo, hi) below zarr_end: straight from the objects' raw inner chunks where the array's are
        raw (dflash.store.direct.DirectReads), else decoded by zarr."""
        direct = self._direct_reads(name)
        if direct is None:
            if out is None:
                return self._zarr_read(name, lo, hi)
            from zarr.core.buffer.cpu import NDBuffer

            self._zarr_read(name, lo, hi, out=NDBuffer.from_numpy_array(out))
            return out
        if out is None:
            out = np.empty((hi - lo, *direct.row), dtype=direct.dtype)
        try:
            direct.read_into(lo, hi, out)
        except (OSError, ValueError) as e:
            raise StoreError(
                f"{self.dir}: rows [{lo}, {hi}) of {name} cannot be decoded ({type(e).__name__}: {e}); the shard is "
                f"damaged. Run `dflash verify {self.dir.parent}` to list the damaged samples, then re-run "
                "`dflash precompute` into a new store (another --out)."
            ) from e
        return out

    def rows(self, name: str, lo: int, hi: int) -> np.ndarray:
        if hi > self.end:
            raise StoreError(f"{self.dir}: rows [{lo}, {hi}) are past the committed end {self.end}.")
        self._need_tail(hi)  # first: it may move zarr_end
        parts = []
        if lo < self.zarr_end:
            parts.append(self._object_read(name, lo, min(hi, self.zarr_end)))
        if hi > self.zarr_end:
            # copy: Arrow memory is read-only, and torch tensors made from it must be writable
            parts.append(self._tail[name][max(lo, self.zarr_end) - self.zarr_end : hi - self.zarr_end].copy())
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def rows_into(self, name: str, lo: int, hi: int, out: np.ndarray) -> None:
        """rows(name, lo, hi) written into `out` (same dtype, hi - lo rows), which saves the loader a copy of
        every hidden state it reads."""
        if hi > self.end:
            raise StoreError(f"{self.dir}: rows [{lo}, {hi}) are past the committed end {self.end}.")
        self._need_tail(hi)
        mid = min(hi, self.zarr_end)
        if lo < mid:
            self._object_read(name, lo, mid, out[: mid - lo])
        if hi > self.zarr_end:
            start = max(lo, self.zarr_end)
            out[start - lo :] = self.rows(name, start, hi)


MAX_LISTED = 20


def shard_problems(name: str, data: ShardData, c: layout.Committed, specs: dict) -> tuple[list[str], bool]:
    """(problems, arrays_ok) of one shard's committed index against its arrays' metadata; reads no data.

    The index must be sorted and contiguous (offset[i+1] = offset[i] + length[i], from 0 to the committed
    end), with unique ids and sane lengths; every array must open with the dtype and row width the manifest
    implies and hold the rows the index needs.  Used by open_store (refuses on any) and by verify."""
    problems = []
    idx = c.index
    ids = idx.column("sample_id").to_numpy()
    off = idx.column("offset").to_numpy()
    ln = idx.column("length").to_numpy()
    sup = idx.column("num_supervised").to_numpy()
    if len(ids) and np.unique(ids).size != len(ids):
        problems.append(f"{name}: duplicate sample ids in the index")
    ends = off + ln
    bad = np.flatnonzero((ln <= 0) | (sup < 0) | (sup > ln))
    for i in bad[:MAX_LISTED]:
        problems.append(f"{name} sample {ids[i]}: length {ln[i]} / supervised {sup[i]} are inconsistent")
    expect = np.concatenate([[0], ends[:-1]]) if len(ids) else off
    for i in np.flatnonzero(off != expect)[:MAX_LISTED]:
        problems.append(f"{name} sample {ids[i]}: offset {off[i]} is not contiguous (expected {expect[i]})")
    total = int(ends[-1]) if len(ids) else 0
    if total != c.end or not 0 <= c.zarr_end <= c.end:
        problems.append(f"{name}: index ends at token {total} but the committed end is {c.end} (Zarr end {c.zarr_end})")
    if not len(ids) and not c.complete:
        return problems, True  # nothing committed yet: the arrays may not exist
    for arr_name, (dtype, row) in specs.items():
        try:
            arr = data.array(arr_name)
        except (StoreError, KeyError) as e:
            problems.append(f"{name}: array {arr_name} cannot be opened ({e})")
            return problems, False
        if arr.dtype != dtype or tuple(arr.shape[1:]) != row:
            problems.append(f"{name}: array {arr_name} is {arr.dtype}{list(arr.shape)}, expected {dtype} rows of "
                            f"{list(row)} (from the manifest's hidden_size, target_layer_ids, topk, hidden_dtype)")
            return problems, False
        if arr.shape[0] < c.zarr_end or (c.complete and arr.shape[0] != c.end):
            problems.append(f"{name}: array {arr_name} has {arr.shape[0]} rows, the index needs {c.end}")
            return problems, False
    return problems, True


def extra_shard_dirs(root: Path, num_shards: int) -> list[str]:
    """Shard directories past the manifest's num_shards (an edited manifest, or shards of another run)."""
    out = []
    for p in root.glob("shard-*"):
        tail = p.name[len("shard-"):]
        if p.is_dir() and tail.isdigit() and int(tail) >= num_shards:
            out.append(p.name)
    return sorted(out)
