"""open_store: the read side of a store.  Start-up reads the manifest and the Arrow indexes, never data.

A `Store` is a snapshot of what was committed when it was opened (layout.load_committed); it opens Zarr
arrays lazily, per process, so it pickles cheaply into DataLoader workers, which reopen on first read.

What a reader checks (docs/DESIGN.md §5).  At open, without reading data: the manifest's keys and types
(manifest.check_manifest); that no shard directory lies past the manifest's `num_shards`; that a shard
marked complete has its `index.arrow`; each index sorted, contiguous from 0 to the committed end, within
the shapes, dtypes and row widths of the arrays (`shard_problems`, shared with verify); with
`require_complete` (training, evaluation), that every shard is complete.  Per sample, on every read
(`verify=True`, the default): the xxh3 checksum of each array read against the index, so a changed or
missing Zarr chunk (which reads as zeros) is a StoreError naming shard, sample and array, not silent
garbage.  Reads of the loader run in its worker processes, off the training step's path.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
import xxhash

from dflash.errors import DamagedSampleError, StoreError
from dflash.store import layout
from dflash.store.manifest import read_manifest, require_final_hidden, shard_name
from dflash.store.rows import dequantise_fp8
from dflash.store.shard_data import ShardData, extra_shard_dirs, shard_problems


def decode_hidden(bits: np.ndarray, scale: np.ndarray | None) -> torch.Tensor:
    """Stored hidden rows -> bf16 tensor [T, L*H] (fp8 rows are dequantised with their per-layer scale)."""
    if scale is None:
        return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)
    return dequantise_fp8(torch.from_numpy(np.ascontiguousarray(bits)), torch.from_numpy(np.ascontiguousarray(scale)))


def _damaged(path: Path, problems: list[str]) -> StoreError:
    listed = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
    return StoreError(
        f"store {path} is damaged ({listed}). Run `dflash verify {path}` for the full report, then re-run "
        "`dflash precompute` into a new store (another --out) and use that one."
    )


class Store:
    """The committed samples of a store.  `require_complete` refuses a store that precompute has not
    finished; `verify` (default on) checks each sample's checksums as it is read; `upto` (a `counts()` of
    an earlier snapshot) keeps only the first samples each shard had then, so that a growing store reads
    as it was (shards only ever append)."""

    def __init__(self, path: str | os.PathLike, require_complete: bool = False, verify: bool = True,
                 upto: dict[str, int] | None = None):
        self.path = Path(path)
        self.verify = verify
        self.manifest = read_manifest(self.path)
        m = self.manifest
        extra = extra_shard_dirs(self.path, int(m["num_shards"]))
        if extra:
            raise StoreError(
                f"store {self.path}: the manifest says num_shards {m['num_shards']}, but shard directories "
                f"{extra[:5]} exist past it; the manifest was edited or the directories belong to another run. "
                "Restore the original manifest, or re-run `dflash precompute` into a new store (another --out)."
            )
        if require_complete:
            self._check_complete()
        self.target_layer_ids = list(m.get("target_layer_ids") or [])
        self.num_layers = len(self.target_layer_ids)
        self.hidden_size = int((m.get("target") or {}).get("hidden_size") or m.get("hidden_size") or 0)
        self.topk = int(m.get("topk") or 0)
        self.hidden_dtype = m.get("hidden_dtype", "bf16")
        self.final_hidden = m.get("final_hidden") is True
        self.specs = layout.array_specs(self.hidden_dtype, self.hidden_size * self.num_layers, self.num_layers, self.topk,
                                        self.final_hidden)
        self.shards: list[ShardData] = []
        tables = []
        problems = []
        for i in range(int(m["num_shards"])):
            d = self.path / shard_name(i)
            c = layout.load_committed(d, self.specs)  # a shard not started yet: empty
            data = ShardData(d, c, self.specs)
            if m["shards"][shard_name(i)].get("status") == "complete" and not c.complete:
                problems.append(f"{shard_name(i)} is marked complete but {d / layout.INDEX} is missing")
            problems += shard_problems(shard_name(i), data, c, self.specs)[0]
            self.shards.append(data)
            index = c.index if upto is None else c.index.slice(0, self._upto(upto, shard_name(i), c.index.num_rows))
            tables.append(index.append_column("shard", pa.array(np.full(index.num_rows, i, np.int32))))
        if upto is not None and (gone := sorted(set(upto) - {shard_name(i) for i in range(int(m["num_shards"]))})):
            raise self._shrunk(f"{gone[:3]} no longer exist")
        schema = layout.index_schema(self.specs).append(pa.field("shard", pa.int32()))
        index = pa.concat_tables(tables) if tables else schema.empty_table()
        self.index = index.sort_by("sample_id")
        self._ids = self.index.column("sample_id").to_numpy()
        if len(self._ids) > 1 and (dup := self._ids[1:][self._ids[1:] == self._ids[:-1]]).size:
            raise StoreError(f"store {self.path}: sample id(s) {dup[:5].tolist()} appear in more than one shard.")
        if problems:
            raise _damaged(self.path, problems)
        self._shard = self.index.column("shard").to_numpy()
        self._offset = self.index.column("offset").to_numpy()
        self._length = self.index.column("length").to_numpy()
        self._sums: dict[str, np.ndarray] = {}  # checksum columns as numpy, made on first read per process

    def __getstate__(self):
        return {**self.__dict__, "_sums": {}}  # the index (pickled anyway) holds them

    def counts(self) -> dict[str, int]:
        """Committed samples per shard: this snapshot, for `open_store(path, upto=...)` later."""
        n = np.bincount(self._shard, minlength=len(self.shards)) if len(self._shard) else np.zeros(len(self.shards))
        return {shard_name(i): int(v) for i, v in enumerate(n)}

    def _upto(self, upto: dict[str, int], name: str, committed: int) -> int:
        want = int(upto.get(name, 0))
        if want > committed:
            raise self._shrunk(f"{name} holds {committed} committed samples, the snapshot {want}")
        return want

    def _shrunk(self, what: str) -> StoreError:
        return StoreError(
            f"store {self.path} holds less than the snapshot a training run planned over ({what}): it was "
            "replaced or recaptured, not grown. Resume only on the store the checkpoint was trained on (or a "
            "grown copy of it); otherwise start a new run directory."
        )

    def _checksum(self, name: str, i: int) -> int:
        if name not in self._sums:
            self._sums[name] = self.index.column(f"checksum_{name}").to_numpy()
        return int(self._sums[name][i])

    def _check_complete(self) -> None:
        states = {name: s.get("status", "pending") + ("" if (self.path / name).is_dir() else " (no directory)")
                  for name, s in self.manifest["shards"].items()}
        unfinished = {name: st for name, st in states.items() if st != "complete"}
        if not unfinished:
            return
        listed = ", ".join(f"{name} {st}" for name, st in list(unfinished.items())[:8])
        more = f" and {len(unfinished) - 8} more" if len(unfinished) > 8 else ""
        writing = any(st.startswith("running") for st in unfinished.values())
        raise StoreError(
            f"store {self.path} is not complete ({len(unfinished)} of {len(states)} shard(s) unfinished: "
            f"{listed}{more}). "
            + ("Precompute is still writing it, or was interrupted. " if writing else
               "Precompute has not finished it (it was interrupted, or some shards never started). ")
            + "Wait for a running precompute to finish, or rerun the same `dflash precompute` command: it "
            "resumes from the last commit and finishes the store. Then train or evaluate."
        )

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

    def _stored(self, i: int, name: str, verify: bool) -> np.ndarray:
        """Sample i's stored rows of array `name`, checked against the index's checksum when `verify`."""
        shard, lo = self.shards[int(self._shard[i])], int(self._offset[i])
        rows = shard.rows(name, lo, lo + int(self._length[i]))
        if verify and layout.checksum(rows) != self._checksum(name, i):
            raise self._mismatch(i, name)
        return rows

    def _mismatch(self, i: int, name: str) -> DamagedSampleError:
        shard = shard_name(int(self._shard[i]))
        return DamagedSampleError(
            f"store {self.path}: sample {int(self._ids[i])} in {shard} is damaged: its {name} rows do not match "
            "the checksum in the index (bytes changed on disk, or a Zarr chunk file is missing and read back as "
            f"zeros). Run `dflash verify {self.path}` to list every damaged sample, then re-run `dflash "
            "precompute` into a new store (another --out) and use that one (or train with --skip-damaged to "
            "skip and count such samples).", shard, int(self._ids[i]), name
        )

    def read(self, sample_id: int, fields=None, verify: bool | None = None) -> dict[str, torch.Tensor]:
        """One sample as torch tensors (docs/DESIGN.md §5), with `final_hidden` [T, H] bf16 when the store
        has it; `fields` limits what is read.  Each array read is checked against its checksum (StoreError
        naming shard, sample and array) unless `verify` is False (default: the store's `verify`)."""
        known = layout.FIELDS + ((layout.FINAL,) if self.final_hidden else ())
        fields = known if fields is None else tuple(fields)
        if layout.FINAL in fields and not self.final_hidden:
            require_final_hidden(self.manifest, self.path)
        bad = [f for f in fields if f not in known]
        if bad:
            raise ValueError(f"unknown field(s) {bad}; choose from {known}")
        verify = self.verify if verify is None else verify
        i = self._locate(int(sample_id))
        n = int(self._length[i])
        out = {}
        for f in fields:
            if f.startswith("topk") and not self.topk:
                out[f] = torch.zeros((n, 0), dtype=torch.int64 if f == "topk_ids" else torch.float32)
            elif f in ("hidden", layout.FINAL):
                scale = self._stored(i, f"{f}_scale", verify) if self.hidden_dtype == "fp8" else None
                out[f] = decode_hidden(self._stored(i, f, verify), scale)
            else:
                a = torch.from_numpy(self._stored(i, f, verify))
                out[f] = a.bool() if f == "loss_mask" else a.long() if f.endswith("ids") else a.float()
        return out

    def read_hidden_into(self, sample_id: int, out: torch.Tensor, scale_out: torch.Tensor | None = None,
                         verify: bool | None = None) -> None:
        """The first len(out) hidden rows of a sample written, as stored, into `out`, a contiguous view (e.g.
        of a packed batch): bf16 [T, L*H] for a bf16 store; for an fp8 store, the e4m3 bits as uint8
        [T, L*H] and their scales into `scale_out` (float32 [T, L]), to be dequantised where they are used
        (rows.dequantise_fp8, on the GPU in training).  Checked against the sample's checksums like read()
        (rows past len(out), if any, are read for it too)."""
        fp8 = self.hidden_dtype == "fp8"
        want = torch.uint8 if fp8 else torch.bfloat16
        if out.dtype != want or not out.is_contiguous() or (scale_out is None) == fp8 or (
                fp8 and (scale_out.dtype != torch.float32 or not scale_out.is_contiguous())):
            raise ValueError(f"read_hidden_into on a {self.hidden_dtype} store needs a contiguous "
                             f"{'uint8' if fp8 else 'bf16'} tensor"
                             + (" and a contiguous float32 scale_out" if fp8 else " and no scale_out")
                             + f" (got {out.dtype}); or use read()")
        i = self._locate(int(sample_id))
        if len(out) > int(self._length[i]):
            raise ValueError(f"sample {sample_id} has {int(self._length[i])} tokens, fewer than {len(out)} asked")
        verify = self.verify if verify is None else verify
        self._rows_into(i, "hidden", out.view(torch.int16).numpy().view(np.uint16) if not fp8 else out.numpy(), verify)
        if fp8:
            self._rows_into(i, "hidden_scale", scale_out[: len(out)].numpy(), verify)

    def _rows_into(self, i: int, name: str, dest: np.ndarray, verify: bool) -> None:
        """Sample i's first len(dest) rows of array `name` into `dest`, checked against the index's checksum."""
        shard, lo, n = self.shards[int(self._shard[i])], int(self._offset[i]), int(self._length[i])
        shard.rows_into(name, lo, lo + len(dest), dest)
        if verify:
            h = xxhash.xxh3_64(memoryview(dest).cast("B"))
            if len(dest) < n:
                h.update(memoryview(np.ascontiguousarray(shard.rows(name, lo + len(dest), lo + n))).cast("B"))
            if h.intdigest() != self._checksum(name, i):
                raise self._mismatch(i, name)

    def __repr__(self) -> str:
        return f"Store({str(self.path)!r}, samples={len(self)}, shards={len(self.shards)})"


def open_store(path: str | os.PathLike, require_complete: bool = False, verify: bool = True,
               upto: dict[str, int] | None = None) -> Store:
    """The store at `path`, its structure checked (see the module docstring).  `require_complete`: refuse a
    store precompute has not finished (training and evaluation); `verify`: check checksums on every read;
    `upto`: only what an earlier snapshot (`Store.counts()`) held."""
    return Store(path, require_complete=require_complete, verify=verify, upto=upto)
