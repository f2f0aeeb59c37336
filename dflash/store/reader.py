"""open_store: the read side of a store.  Start-up reads the manifest and the Arrow indexes, never data.

A `Store` is a snapshot of what was committed when it was opened (layout.load_committed); it opens Zarr
arrays lazily, per process, so it pickles cheaply into DataLoader workers, which reopen on first read.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
import zarr
from zarr.storage import LocalStore

from dflash.errors import StoreError
from dflash.store import layout
from dflash.store.manifest import read_manifest, shard_name


class ShardData:
    """Token rows of one shard: Zarr arrays below `zarr_end`, the committed tail file above it."""

    def __init__(self, shard_dir: Path, committed: layout.Committed):
        self.dir = shard_dir
        self.end, self.zarr_end, self.tail_file = committed.end, committed.zarr_end, committed.tail
        self._arrays = None
        self._tail = None

    def __getstate__(self):
        return {**self.__dict__, "_arrays": None, "_tail": None}

    def array(self, name: str) -> zarr.Array:
        if self._arrays is None:
            try:
                self._arrays = zarr.open_group(LocalStore(self.dir, read_only=True), mode="r")
            except Exception as e:  # zarr raises several types for a missing/garbled group
                raise StoreError(f"{self.dir}: Zarr group cannot be opened ({e}); the shard is damaged.") from None
        return self._arrays[name]

    def rows(self, name: str, lo: int, hi: int) -> np.ndarray:
        if hi > self.end:
            raise StoreError(f"{self.dir}: rows [{lo}, {hi}) are past the committed end {self.end}.")
        parts = []
        if lo < self.zarr_end:
            parts.append(self.array(name)[lo : min(hi, self.zarr_end)])
        if hi > self.zarr_end:
            if self._tail is None:
                self._tail = layout.tail_arrays(layout.read_ipc(self.tail_file))
            # copy: Arrow memory is read-only, and torch tensors made from it must be writable
            parts.append(self._tail[name][max(lo, self.zarr_end) - self.zarr_end : hi - self.zarr_end].copy())
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def rows_into(self, name: str, lo: int, hi: int, out: np.ndarray) -> None:
        """rows(name, lo, hi) written into `out` (same dtype, hi - lo rows): Zarr decodes straight into
        it, which saves the loader a copy of every hidden state it reads."""
        from zarr.core.buffer.cpu import NDBuffer

        if hi > self.end:
            raise StoreError(f"{self.dir}: rows [{lo}, {hi}) are past the committed end {self.end}.")
        mid = min(hi, self.zarr_end)
        if lo < mid:
            self.array(name).get_basic_selection(slice(lo, mid), out=NDBuffer.from_numpy_array(out[: mid - lo]))
        if hi > self.zarr_end:
            start = max(lo, self.zarr_end)
            out[start - lo :] = self.rows(name, start, hi)


def decode_hidden(bits: np.ndarray, scale: np.ndarray | None) -> torch.Tensor:
    """Stored hidden rows -> bf16 tensor [T, L*H] (fp8 rows are dequantised with their per-layer scale)."""
    if scale is None:
        return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)
    t, num_layers = scale.shape
    x = torch.from_numpy(np.ascontiguousarray(bits)).view(torch.float8_e4m3fn).float().reshape(t, num_layers, -1)
    return (x * torch.from_numpy(np.ascontiguousarray(scale))[..., None]).reshape(t, -1).to(torch.bfloat16)


class Store:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        m = self.manifest
        self.target_layer_ids = list(m.get("target_layer_ids") or [])
        self.num_layers = len(self.target_layer_ids)
        self.hidden_size = int((m.get("target") or {}).get("hidden_size") or m.get("hidden_size") or 0)
        self.topk = int(m.get("topk") or 0)
        self.hidden_dtype = m.get("hidden_dtype", "bf16")
        self.specs = layout.array_specs(self.hidden_dtype, self.hidden_size * self.num_layers, self.num_layers, self.topk)
        self.shards: list[ShardData] = []
        tables = []
        for i in range(int(m.get("num_shards") or 0)):
            d = self.path / shard_name(i)
            c = layout.load_committed(d, self.specs)  # a shard not started yet: empty
            self.shards.append(ShardData(d, c))
            tables.append(c.index.append_column("shard", pa.array(np.full(c.index.num_rows, i, np.int32))))
        schema = layout.index_schema(self.specs).append(pa.field("shard", pa.int32()))
        index = pa.concat_tables(tables) if tables else schema.empty_table()
        self.index = index.sort_by("sample_id")
        self._ids = self.index.column("sample_id").to_numpy()
        if len(self._ids) > 1 and (dup := self._ids[1:][self._ids[1:] == self._ids[:-1]]).size:
            raise StoreError(f"store {self.path}: sample id(s) {dup[:5].tolist()} appear in more than one shard.")
        self._shard = self.index.column("shard").to_numpy()
        self._offset = self.index.column("offset").to_numpy()
        self._length = self.index.column("length").to_numpy()

    @property
    def complete(self) -> bool:
        return all(s.get("status") == "complete" for s in self.manifest["shards"].values())

    def __len__(self) -> int:
        return len(self._ids)

    def sample_ids(self) -> list[int]:
        return self._ids.tolist()

    def lengths(self) -> np.ndarray:
        return self._length.astype(np.int64)

    def num_supervised(self) -> np.ndarray:
        return self.index.column("num_supervised").to_numpy().astype(np.int64)

    @property
    def num_tokens(self) -> int:
        return int(self._length.sum())

    def _locate(self, sample_id: int) -> int:
        i = int(np.searchsorted(self._ids, sample_id))
        if i >= len(self._ids) or self._ids[i] != sample_id:
            raise KeyError(f"sample {sample_id} is not in store {self.path}")
        return i

    def read(self, sample_id: int, fields=None) -> dict[str, torch.Tensor]:
        """One sample as torch tensors (docs/DESIGN.md §5); `fields` limits what is read."""
        fields = layout.FIELDS if fields is None else tuple(fields)
        bad = [f for f in fields if f not in layout.FIELDS]
        if bad:
            raise ValueError(f"unknown field(s) {bad}; choose from {layout.FIELDS}")
        i = self._locate(int(sample_id))
        shard, lo = self.shards[int(self._shard[i])], int(self._offset[i])
        hi = lo + int(self._length[i])
        out = {}
        for f in fields:
            if f.startswith("topk") and not self.topk:
                out[f] = torch.zeros((hi - lo, 0), dtype=torch.int64 if f == "topk_ids" else torch.float32)
            elif f == "hidden":
                scale = shard.rows("hidden_scale", lo, hi) if self.hidden_dtype == "fp8" else None
                out[f] = decode_hidden(shard.rows("hidden", lo, hi), scale)
            else:
                a = torch.from_numpy(shard.rows(f, lo, hi))
                out[f] = a.bool() if f == "loss_mask" else a.long() if f.endswith("ids") else a.float()
        return out

    def read_hidden_into(self, sample_id: int, out: torch.Tensor) -> None:
        """The first len(out) hidden rows of a sample written into `out` (a contiguous bf16 [T, L*H] view,
        e.g. of a packed batch).  bf16 stores only: fp8 needs read()'s dequantisation."""
        if self.hidden_dtype != "bf16" or out.dtype != torch.bfloat16 or not out.is_contiguous():
            raise ValueError(f"read_hidden_into needs a bf16 store and a contiguous bf16 tensor (store "
                             f"{self.hidden_dtype}, tensor {out.dtype}); use read()")
        i = self._locate(int(sample_id))
        shard, lo = self.shards[int(self._shard[i])], int(self._offset[i])
        if len(out) > int(self._length[i]):
            raise ValueError(f"sample {sample_id} has {int(self._length[i])} tokens, fewer than {len(out)} asked")
        shard.rows_into("hidden", lo, lo + len(out), out.view(torch.int16).numpy().view(np.uint16))

    def __repr__(self) -> str:
        return f"Store({str(self.path)!r}, samples={len(self)}, shards={len(self.shards)})"


def open_store(path: str | os.PathLike) -> Store:
    return Store(path)
