"""Which parts of a store a precompute run captures: the store's first part, an unfinished one, or, with
`--append`, a new part of the conversations the store does not hold yet (docs/DESIGN.md §5).

Runs in the launcher, under the store's lock, after every input was checked.  Crash safety comes from the
order: a part is recorded (its rows chosen, dflash/store/parts.py) before any of its shards starts, and
is finished by the next run over the same dataset before anything else; so a rerun after `kill -9`
anywhere redoes exactly what the interrupted run had left.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dflash.config import PrecomputeConfig
from dflash.errors import ConfigError, StoreError
from dflash.paths import from_record, portable
from dflash.precompute.badrows import write_report
from dflash.store import parts as P
from dflash.store import read_manifest


@dataclass
class DatasetKeys:
    """The dataset as precompute sees it: one content key per row (dflash.chat.conversation_key)."""

    keys: list[bytes | None]  # None: a bad row that --skip-bad-rows leaves out
    fingerprint: str
    bad: list[dict] = field(default_factory=list)  # the rows left out, each with its reason (badrows.py)

    def unique(self, held: set[bytes] = frozenset()) -> tuple[np.ndarray, dict]:
        """Rows of conversations neither held nor seen earlier in the dataset, and the counts."""
        seen, rows, dup, known = set(), [], 0, 0
        for r, k in enumerate(self.keys):
            if k is None:
                continue
            if k in held:
                known += 1
            elif k in seen:
                dup += 1
            else:
                seen.add(k)
                rows.append(r)
        counts = {"new": len(rows), "duplicates": dup, "already_stored": known}
        if self.bad:
            counts["bad_rows"] = len(self.bad)
        return np.asarray(rows, dtype=np.int64), counts


def unfinished(out: Path, parts: list[P.Part]) -> list[P.Part]:
    shards = read_manifest(out)["shards"]
    return [p for p in parts if any(shards[f"shard-{i:05d}"].get("status") != "complete" for i in p.shards)]


def _dataset_info(cfg: PrecomputeConfig, counts: dict) -> dict:
    return {"dataset": portable(cfg.data, cfg.out), "split": cfg.split, "max_samples": cfg.max_samples, **counts}


def first_part(cfg: PrecomputeConfig, out: Path, rows: DatasetKeys, num_shards: int) -> P.Part:
    """Part 0 of a store whose manifest exists (just written, or written by a run killed right after)."""
    found = P.read_parts(out)
    if found:
        return found[0]
    unique, counts = rows.unique()
    part = P.Part(0, 0, num_shards, 0, rows.fingerprint, len(rows.keys), _dataset_info(cfg, counts))
    write_report(out, 0, rows.bad)
    return P.write_part(out, part, [rows.keys[r] for r in unique], unique)


def plan_parts(cfg: PrecomputeConfig, out: Path, manifest: dict, rows: DatasetKeys, num_shards: int) -> list[P.Part]:
    """The parts whose shards this run captures, in order (recording a new one for --append)."""
    found = P.read_parts(out)
    parts = found or [first_part(cfg, out, rows, int(manifest["num_shards"]))]
    todo = unfinished(out, parts)
    for p in todo:  # a crashed run's part is finished first, from its own dataset
        if p.dataset_fingerprint != rows.fingerprint:
            raise StoreError(
                f"store {out}: part {p.index} (from {from_record(p.info.get('dataset'), out)}, "
                f"{p.summary().get('new', '?')} conversations) was interrupted before it finished. Finish it first "
                f"by rerunning `dflash precompute --append --data {from_record(p.info.get('dataset'), out)}` with "
                "the rest of that run's options, "
                "then append this dataset."
            )
        if p.num_shards != num_shards:
            raise ConfigError(
                f"store {out}: part {p.index} was started with {p.num_shards} shard(s); resume it with "
                f"--shards {p.num_shards} (under torchrun, {p.num_shards} processes), then append with any count."
            )
    if not cfg.append:
        if all(p.dataset_fingerprint != rows.fingerprint for p in parts):
            raise StoreError(
                f"store {out} was written from another dataset than {cfg.data} (its parts: "
                f"{', '.join(str(from_record(p.info.get('dataset'), out)) for p in parts)}). To add the conversations of a grown "
                "or new dataset to it, pass --append; to start the store over, pass --overwrite; or choose "
                "another --out."
            )
        return todo
    if not found:  # a store this run begins: its part 0 is this dataset, nothing is left to append
        return todo
    unique, counts = rows.unique(P.held_keys(out, parts))
    if not len(unique):
        print(f"precompute --append: {cfg.data}: all {len(rows.keys)} rows are held by store {out} "
              f"({counts['already_stored']} stored, {counts['duplicates']} repeated in the dataset); "
              "nothing to add.", flush=True)
        return todo
    last = parts[-1]
    new = P.Part(last.index + 1, last.first_shard + last.num_shards, num_shards, max(p.id_end for p in parts),
                 rows.fingerprint, len(rows.keys), _dataset_info(cfg, counts))
    write_report(out, new.index, rows.bad)
    new = P.write_part(out, new, [rows.keys[r] for r in unique], unique)
    print(f"precompute --append: part {new.index} of {out}: {counts['new']} new conversations from {cfg.data} "
          f"({counts['already_stored']} already stored, {counts['duplicates']} repeated in the dataset), "
          f"shards {new.first_shard}-{new.first_shard + new.num_shards - 1}.", flush=True)
    return [*todo, new]


__all__ = ["DatasetKeys", "first_part", "plan_parts", "unfinished"]
