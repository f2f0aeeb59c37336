"""verify_store: check a store end to end and name every problem by shard and sample id.

Checks: the manifest (keys and types; no shard directory past its num_shards); every shard complete; each index sorted, contiguous (offset[i+1] = offset[i] +
length[i], starting at 0, ending at the committed end), within the arrays' shapes, with unique sample
ids (across shards too); and, with `checksums`, every sample's xxh3 checksum per array and its
supervised-token count recomputed from the stored bytes.  Data is read in large contiguous blocks; a
block that cannot be decoded (a corrupted compressed chunk or shard index) is re-read sample by sample
so the report names the samples it holds instead of crashing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dflash.errors import StoreError
from dflash.store import layout
from dflash.store.manifest import read_manifest, shard_name
from dflash.store.shard_data import MAX_LISTED, ShardData, extra_shard_dirs, shard_problems

BLOCK_BYTES = 256 * 2**20  # data read per block while checksumming


@dataclass
class Report:
    path: str
    num_shards: int = 0
    num_samples: int = 0
    num_tokens: int = 0
    num_bytes: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        bpt = self.num_bytes / self.num_tokens if self.num_tokens else 0.0
        state = "OK" if self.ok else f"{len(self.problems)} problem(s)"
        return (
            f"{self.path}: {self.num_shards} shards, {self.num_samples} samples, {self.num_tokens} tokens, "
            f"{bpt:.0f} bytes/token: {state}"
        )

    def problem_message(self) -> str:
        if self.ok:
            return ""
        listed = "; ".join(self.problems[:MAX_LISTED])
        more = f"; and {len(self.problems) - MAX_LISTED} more" if len(self.problems) > MAX_LISTED else ""
        return (
            f"store {self.path} has {len(self.problems)} problem(s): {listed}{more}. Rerun the same "
            "`dflash precompute` command to finish incomplete shards; for a damaged shard delete its "
            "directory and rerun (or start over with --overwrite)."
        )


def _dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file()) if d.is_dir() else 0


def _check_shard(name: str, data: ShardData, c: layout.Committed, specs: dict, checksums: bool, problems: list[str]) -> None:
    found, arrays_ok = shard_problems(name, data, c, specs)
    problems += found
    if not arrays_ok:
        return
    idx = c.index
    ids = idx.column("sample_id").to_numpy()
    off = idx.column("offset").to_numpy()
    ln = idx.column("length").to_numpy()
    sup = idx.column("num_supervised").to_numpy()
    ends = off + ln
    if not checksums or not len(ids):
        return
    cols = {"ids": ids, "off": off, "ln": ln, "sup": sup}
    cols.update({a: idx.column(f"checksum_{a}").to_numpy() for a in specs})
    row_bytes = sum(d.itemsize * int(np.prod(r)) for d, r in specs.values())
    budget = max(1, BLOCK_BYTES // row_bytes)
    i = 0
    while i < len(ids):  # blocks of whole samples, ~BLOCK_BYTES each
        j = min(len(ids), i + 1 + int(np.searchsorted(ends[i + 1 :], off[i] + budget, side="right")))
        _check_block(name, data, specs, {k: v[i:j] for k, v in cols.items()}, problems)
        i = j


def _check_block(name: str, data: ShardData, specs: dict, b: dict, problems: list[str]) -> None:
    """Checksums of the samples `b` (consecutive), read as one block; sample by sample if it fails."""
    lo, hi = int(b["off"][0]), int(b["off"][-1] + b["ln"][-1])
    n = len(b["ids"])
    try:
        block = {a: data.rows(a, lo, hi) for a in specs}
    except Exception:
        if n > 1:  # narrow the failure down to the samples whose chunks do not decode
            for k in range(n):
                _check_block(name, data, specs, {key: v[k : k + 1] for key, v in b.items()}, problems)
            return
        block = {}
        for a in specs:
            try:
                block[a] = data.rows(a, lo, hi)
            except Exception as e:
                problems.append(f"{name} sample {b['ids'][0]}: {a} cannot be decoded ({type(e).__name__}: {e})")
    for k in range(n):
        s, e = int(b["off"][k]) - lo, int(b["off"][k] + b["ln"][k]) - lo
        for a, rows in block.items():
            if layout.checksum(rows[s:e]) != b[a][k]:
                problems.append(f"{name} sample {b['ids'][k]}: {a} checksum mismatch (stored bytes changed)")
        if "loss_mask" in block and (c := int(np.count_nonzero(block["loss_mask"][s:e]))) != b["sup"][k]:
            problems.append(f"{name} sample {b['ids'][k]}: loss_mask has {c} supervised tokens, index says {b['sup'][k]}")


def verify_store(path: str | os.PathLike, checksums: bool = True) -> Report:
    """Check a store; StoreError only when there is no store at `path` at all."""
    root = Path(path)
    m = read_manifest(root)
    report = Report(str(root), num_shards=m["num_shards"])
    L = len(m.get("target_layer_ids") or [])
    H = int((m.get("target") or {}).get("hidden_size") or m.get("hidden_size") or 0)
    try:
        specs = layout.array_specs(m.get("hidden_dtype", "bf16"), H * L, L, int(m.get("topk") or 0),
                                   m.get("final_hidden") is True)
    except StoreError as e:
        report.problems.append(f"manifest: {e}")
        return report
    for extra in extra_shard_dirs(root, report.num_shards):
        report.problems.append(f"{extra}: a shard directory past the manifest's num_shards {report.num_shards}")
    seen: dict[int, str] = {}
    for i in range(report.num_shards):
        name = shard_name(i)
        d = root / name
        status = m["shards"][name].get("status")
        if not d.is_dir():
            report.problems.append(f"{name}: no shard directory, though the manifest says num_shards "
                                   f"{report.num_shards} (precompute never started it, or the manifest was edited)")
            continue
        if status != "complete":
            report.problems.append(f"{name}: not complete (status {status})")
        try:
            c = layout.load_committed(d, specs)
        except StoreError as e:
            report.problems.append(f"{name}: {e}")
            continue
        if status == "complete" and not c.complete:
            report.problems.append(f"{name}: marked complete but its index was never consolidated")
        for sid in c.index.column("sample_id").to_pylist():
            if sid in seen:
                report.problems.append(f"{name} sample {sid}: also in {seen[sid]}")
            seen[sid] = name
        report.num_samples += c.index.num_rows
        report.num_tokens += c.end
        report.num_bytes += _dir_bytes(d)
        _check_shard(name, ShardData(d, c, specs), c, specs, checksums, report.problems)
    return report
