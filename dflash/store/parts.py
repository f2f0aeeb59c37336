"""Parts: how a store grows (docs/DESIGN.md §5).

A store is a sequence of parts.  Part 0 is what the first `dflash precompute` captured; each
`dflash precompute --append` that finds conversations the store does not hold adds the next part, with
shards of its own numbered after the last part's.  `STORE/parts/part-00000.arrow` (Arrow IPC) records a
part before any of its shards starts, atomically (tmp + fsync + rename), and is never changed again:

    columns   key (16 bytes: dflash.chat.conversation_key), row (its row in the part's dataset)
              - the conversations the part covers, each once, in row order
    metadata  "part": JSON {index, first_shard, num_shards, id_base, dataset_fingerprint, dataset,
              num_rows, duplicates, already_stored} (no time: when it was made is in the store's run
              record, dflash/store/runinfo.py)

Shard `first_shard + j` of a part captures the part's rows `j::num_shards`, and stores row r as sample
id `id_base + r`; `id_base` is past every id an earlier part can use (its id_base + num_rows), so ids
are unique over the store and a pure function of the parts.  A store without a `parts/` directory (its
shards written directly, not by `dflash precompute`) is read as one part.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from dflash.durable import atomic_write_bytes
from dflash.errors import StoreError
from dflash.store import layout

PARTS = "parts"
KEY_BYTES = 16
_PART_RE = re.compile(r"^part-(\d{5})\.arrow$")


@dataclass(frozen=True)
class Part:
    index: int
    first_shard: int
    num_shards: int
    id_base: int
    dataset_fingerprint: str
    num_rows: int  # rows of the part's dataset (its ids span id_base .. id_base + num_rows)
    info: dict = field(default_factory=dict, compare=False)  # dataset path, counts

    @property
    def shards(self) -> range:
        return range(self.first_shard, self.first_shard + self.num_shards)

    @property
    def id_end(self) -> int:
        return self.id_base + self.num_rows

    @classmethod
    def from_summary(cls, d: dict) -> Part:
        return _part_of(d, Path("<part summary>"))

    def summary(self) -> dict:
        return {"index": self.index, "first_shard": self.first_shard, "num_shards": self.num_shards,
                "id_base": self.id_base, "dataset_fingerprint": self.dataset_fingerprint,
                "num_rows": self.num_rows, **self.info}


def part_path(root: str | os.PathLike, index: int) -> Path:
    return Path(root) / PARTS / f"part-{int(index):05d}.arrow"


def _part_of(meta: dict, where: Path) -> Part:
    try:
        info = {k: v for k, v in meta.items() if k not in
                ("index", "first_shard", "num_shards", "id_base", "dataset_fingerprint", "num_rows")}
        return Part(int(meta["index"]), int(meta["first_shard"]), int(meta["num_shards"]), int(meta["id_base"]),
                    str(meta["dataset_fingerprint"]), int(meta["num_rows"]), info)
    except (KeyError, TypeError, ValueError) as e:
        raise StoreError(f"{where}: the part record is damaged ({type(e).__name__}: {e}); it was edited or "
                         "truncated. Restore it, or re-run `dflash precompute` into a new store.") from None


def _read_part_file(path: Path, with_keys: bool) -> tuple[Part, pa.Table | None]:
    try:
        with pa.memory_map(str(path)) as src:
            reader = pa.ipc.open_file(src)
            meta = json.loads((reader.schema.metadata or {}).get(b"part", b"{}"))
            table = reader.read_all() if with_keys else None
    except (OSError, pa.ArrowInvalid, ValueError) as e:
        raise StoreError(f"{path} cannot be read ({e}); the store's part record is damaged. Restore it, or re-run "
                         "`dflash precompute` into a new store.") from None
    return _part_of(meta, path), table


def read_parts(root: str | os.PathLike) -> list[Part]:
    """The store's parts, in order (metadata only); [] for a store without part records."""
    d = Path(root) / PARTS
    if not d.is_dir():
        return []
    nums = sorted(int(m.group(1)) for p in d.iterdir() if (m := _PART_RE.match(p.name)))
    parts = [_read_part_file(part_path(root, n), with_keys=False)[0] for n in nums]
    shard, ids = 0, 0
    for n, p in enumerate(parts):
        if nums[n] != n or p.index != n or p.first_shard != shard or p.id_base < ids:
            raise StoreError(f"{d}: the part records of store {root} are not contiguous (found {nums[:8]}, part "
                             f"{p.index} at shard {p.first_shard}, expected part {n} at shard {shard}); one is "
                             "missing or was edited. Restore it, or re-run `dflash precompute` into a new store.")
        shard, ids = shard + p.num_shards, p.id_end
    return parts


def part_rows(root: str | os.PathLike, index: int) -> np.ndarray:
    """The dataset rows part `index` covers, in row order (int64)."""
    _, table = _read_part_file(part_path(root, index), with_keys=True)
    return table.column("row").to_numpy().astype(np.int64)


def held_keys(root: str | os.PathLike, parts: list[Part]) -> set[bytes]:
    """Every conversation key any of `parts` covers."""
    held: set[bytes] = set()
    for p in parts:
        _, table = _read_part_file(part_path(root, p.index), with_keys=True)
        held.update(table.column("key").to_pylist())
    return held


def write_part(root: str | os.PathLike, part: Part, keys: list[bytes], rows: np.ndarray) -> Part:
    """Record `part` (covering `keys` at dataset `rows`) atomically; the commit point of an append."""
    if len(keys) != len(rows):
        raise ValueError("one key per row")
    meta = part.summary()
    table = pa.table({"key": pa.array(keys, type=pa.binary(KEY_BYTES)),
                      "row": pa.array(np.asarray(rows, dtype=np.int64))})
    table = table.replace_schema_metadata({"part": json.dumps(meta, sort_keys=True)})
    path = part_path(root, part.index)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, layout.to_ipc_bytes(table))
    return _part_of(meta, path)


__all__ = ["PARTS", "Part", "held_keys", "part_path", "part_rows", "read_parts", "write_part"]
