"""On-disk layout of one shard, shared by the writer, the reader and verify.

    shard-00000/
      zarr.json, input_ids/, loss_mask/, hidden/, [hidden_scale/], [topk_ids/, topk_logprobs/],
                 [final_hidden/, [final_hidden_scale/]]
                                 Zarr v3 group, token-major arrays, sharding codec
      index/seg-000000.arrow ... Arrow IPC index segments, one per commit (while the shard is written)
      tail-000000012345.arrow    the committed tokens past the last full Zarr shard object (see writer.py)
      index.arrow                the consolidated index, written by finalize(); replaces segments + tail
      status.json               pending | running | complete, + stats (manifest.py)

Index columns: sample_id, source_row, offset, length, num_supervised (int64) and one xxh3-64 checksum
per stored array, `checksum_<array>` (uint64), over the raw bytes of the sample's rows of that array.
The schema metadata of the last segment (or of index.arrow) holds `end` (committed token end) and
`zarr_end` (tokens below it are in the Zarr arrays, tokens in [zarr_end, end) in the tail file).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import xxhash

from dflash.errors import StoreError

INDEX = "index.arrow"
SEGMENTS = "index"
_SEG_RE = re.compile(r"^seg-(\d{6})\.arrow$")
_TAIL_RE = re.compile(r"^tail-(\d{12})\.arrow$")
CHECKSUM = "xxh3_64"

# Fields a caller can ask `Store.read` for, in storage order; FINAL only of a store made with it.
FIELDS = ("input_ids", "loss_mask", "hidden", "topk_ids", "topk_logprobs")
FINAL = "final_hidden"


def array_specs(hidden_dtype: str, width: int, num_layers: int, topk: int,
                final_hidden: bool = False) -> dict[str, tuple[np.dtype, tuple]]:
    """name -> (numpy dtype, shape of one token's row) for every array a shard stores.

    `final_hidden`: the target's last hidden state too ([T, H], H = width / num_layers), encoded as one more
    layer of `hidden` is.  Its arrays come last, so a store without them has the columns and bytes it had
    before the option existed."""
    if hidden_dtype not in ("bf16", "fp8"):
        raise StoreError(f"hidden_dtype must be 'bf16' or 'fp8', got {hidden_dtype!r}.")
    specs = {
        "input_ids": (np.dtype("int32"), ()),
        "loss_mask": (np.dtype("uint8"), ()),
        "hidden": (np.dtype("uint16" if hidden_dtype == "bf16" else "uint8"), (width,)),
    }
    if hidden_dtype == "fp8":
        specs["hidden_scale"] = (np.dtype("float32"), (num_layers,))
    if topk > 0:
        specs["topk_ids"] = (np.dtype("int32"), (topk,))
        specs["topk_logprobs"] = (np.dtype("float32"), (topk,))
    if final_hidden:
        specs[FINAL] = (specs["hidden"][0], (width // num_layers,))
        if hidden_dtype == "fp8":
            specs[f"{FINAL}_scale"] = (np.dtype("float32"), (1,))
    return specs


def index_schema(array_names) -> pa.Schema:
    cols = [(n, pa.int64()) for n in ("sample_id", "source_row", "offset", "length", "num_supervised")]
    cols += [(f"checksum_{n}", pa.uint64()) for n in array_names]
    return pa.schema(cols)


def checksum(a: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(memoryview(np.ascontiguousarray(a)).cast("B"))


def seg_path(shard_dir: Path, n: int) -> Path:
    return shard_dir / SEGMENTS / f"seg-{n:06d}.arrow"


def tail_path(shard_dir: Path, end: int) -> Path:
    return shard_dir / f"tail-{end:012d}.arrow"


# ----------------------------------------------------------------------------------------------------
# Arrow IPC helpers


def to_ipc_bytes(table: pa.Table) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue()


def read_ipc(path: Path, missing_ok: bool = False) -> pa.Table | None:
    try:
        with pa.memory_map(str(path)) as src:
            return pa.ipc.open_file(src).read_all()
    except FileNotFoundError:
        if missing_ok:
            return None
        raise StoreError(f"{path} is missing; the store is damaged: rerun precompute with --overwrite.") from None
    except (OSError, pa.ArrowInvalid) as e:
        raise StoreError(f"{path} cannot be read ({e}); the store is damaged: rerun precompute with --overwrite.") from None


def _meta(table: pa.Table, key: str) -> int:
    md = table.schema.metadata or {}
    return int(md[key.encode()])


def with_meta(table: pa.Table, **kv) -> pa.Table:
    return table.replace_schema_metadata({k: str(v) for k, v in kv.items()})


def tail_table(arrays: dict[str, np.ndarray], start: int, end: int) -> pa.Table:
    """Token rows [start, end) of every array as one Arrow table (2-D arrays as fixed-size lists)."""
    cols = {}
    for name, a in arrays.items():
        flat = pa.array(np.ascontiguousarray(a).reshape(-1))
        cols[name] = flat if a.ndim == 1 else pa.FixedSizeListArray.from_arrays(flat, a.shape[1])
    return with_meta(pa.table(cols), start=start, end=end)


def tail_arrays(table: pa.Table) -> dict[str, np.ndarray]:
    out = {}
    for name in table.column_names:
        col = table.column(name).combine_chunks()
        if pa.types.is_fixed_size_list(col.type):
            out[name] = col.values.to_numpy(zero_copy_only=False).reshape(len(col), col.type.list_size)
        else:
            out[name] = col.to_numpy(zero_copy_only=False)
    return out


# ----------------------------------------------------------------------------------------------------
# the committed state of a shard: the only thing a reader trusts


@dataclass
class Committed:
    index: pa.Table  # one row per committed sample, in offset order
    end: int  # committed token end
    zarr_end: int  # tokens [0, zarr_end) are in the Zarr arrays, [zarr_end, end) in `tail`
    tail: Path | None
    complete: bool  # finalize() consolidated the index
    num_segments: int


def load_committed(shard_dir: Path, array_names) -> Committed:
    """The shard's committed state.  A writer at work commits segment n+1 and then removes the tail that
    segment n named, so a reader that listed the segments just before finds that tail gone: it lists
    them again (the newer segment, or the final index, is there by then); a tail missing while the
    shard stays where it was is damage."""
    for _ in range(100):
        try:
            c = _load_committed_once(shard_dir, array_names)
        except FileNotFoundError:  # finalize() removed the segments after writing the final index
            continue
        if c.tail is None or c.tail.is_file():
            return c
        try:
            again = _load_committed_once(shard_dir, array_names)
        except FileNotFoundError:
            continue
        if (again.complete, again.num_segments) == (c.complete, c.num_segments):
            raise StoreError(f"{c.tail} is missing; shard {shard_dir} is damaged. Delete it and rerun precompute.")
    raise StoreError(f"{shard_dir}: its committed state kept changing while it was read; is a writer committing "
                     "hundreds of times a second?")


def _load_committed_once(shard_dir: Path, array_names) -> Committed:
    schema = index_schema(array_names)
    final = shard_dir / INDEX
    if final.is_file():
        t = read_ipc(final)
        return Committed(t, _meta(t, "end"), _meta(t, "zarr_end"), None, True, 0)
    seg_dir = shard_dir / SEGMENTS
    nums = sorted(int(m.group(1)) for p in (seg_dir.iterdir() if seg_dir.is_dir() else ()) if (m := _SEG_RE.match(p.name)))
    if not nums:
        return Committed(schema.empty_table(), 0, 0, None, False, 0)
    if nums != list(range(len(nums))):
        missing = sorted(set(range(nums[-1] + 1)) - set(nums))
        raise StoreError(
            f"{seg_dir}: index segment(s) {missing} are missing; the shard is damaged. Delete {shard_dir} "
            "and rerun precompute to rewrite this shard."
        )
    tables = [read_ipc(seg_path(shard_dir, n), missing_ok=True) for n in nums]
    if any(t is None for t in tables):  # listed, then removed by finalize(): the caller looks again
        raise FileNotFoundError(seg_dir)
    end, zarr_end = _meta(tables[-1], "end"), _meta(tables[-1], "zarr_end")
    index = pa.concat_tables([t.replace_schema_metadata(None) for t in tables])
    tail = tail_path(shard_dir, end) if end > zarr_end else None
    return Committed(index, end, zarr_end, tail, False, len(nums))


def stale_files(shard_dir: Path, committed: Committed) -> list[Path]:
    """Leftovers of an interrupted writer that no committed state refers to (safe to delete)."""
    out = [p for p in shard_dir.rglob("*") if p.is_file() and (p.name.endswith(".partial") or ".tmp-" in p.name)]
    for p in shard_dir.glob("tail-*.arrow"):
        if p != committed.tail:
            out.append(p)
    if committed.complete and (shard_dir / SEGMENTS).is_dir():
        out += list((shard_dir / SEGMENTS).iterdir())
    return out
