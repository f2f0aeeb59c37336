"""How a store was made, kept beside the store rather than in it.

A store's bytes are a function of its inputs (the rows, the target, the options that decide what is
captured, and the code): two runs of the same inputs write the same files, whatever the machine's speed,
the number of render workers, or a `kill -9` and rerun on the way.  So nothing in the store says when,
where or how fast it was written.  That goes to `<parent>/<store name>.run/`, beside the store, where
hashing the store (DVC, sha256sum, rsync -c) does not see it:

    train.run/precompute.jsonl   one line per `dflash precompute` that captured something: when it started
                                 and ended, on which host, the options that change how it ran but not what
                                 it wrote (render workers, writer, GPUs), the parts it captured, its totals
    train.run/shard-00000.json   the shard's timings and rates from its latest run (status.json in the
                                 store keeps only what the data decides: status and counts)

`shard_status` (dflash.store.manifest) returns both merged, so readers see one dict per shard as before.
Everything here is for people; no reader trusts it, and a missing or damaged file only loses the record.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dflash.durable import atomic_write_bytes

RUNS = "precompute.jsonl"
# The shard statistics that are a function of the data, kept in the store's status.json; every other
# statistic describes the run.
DATA_STATS = ("status", "num_samples", "num_tokens", "num_supervised", "rows", "skipped", "cut_away", "truncated")
# Options of `dflash precompute` that change how a run goes but not the bytes it writes (or that name the
# store itself): recorded per run here, left out of the manifest's precompute_config.
RUN_OPTIONS = ("out", "gpus", "render_workers", "writer", "commit_every_tokens", "overwrite", "restart_changed",
               "append", "space_check")


def run_dir(store: str | os.PathLike) -> Path:
    """`<parent>/<name>.run`: beside the store, so that the store's bytes stay its data's."""
    d = Path(os.path.abspath(store))
    return d.with_name(d.name + ".run")


def split_stats(stats: dict) -> tuple[dict, dict]:
    """(what the data decides, what describes the run) of a shard's statistics."""
    data = {k: v for k, v in stats.items() if k in DATA_STATS}
    return data, {k: v for k, v in stats.items() if k not in DATA_STATS}


def _shard_file(store, name: str) -> Path:
    return run_dir(store) / f"{name}.json"


def write_shard_run(store: str | os.PathLike, name: str, stats: dict) -> None:
    """Record shard `name`'s run statistics (one writer per shard, as for its status file)."""
    path = _shard_file(store, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, (json.dumps(stats, indent=2, sort_keys=True, default=str) + "\n").encode())


def read_shard_run(store: str | os.PathLike, name: str) -> dict:
    """Shard `name`'s run statistics; {} when there are none (or they cannot be read)."""
    try:
        found = json.loads(_shard_file(store, name).read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def record_run(store: str | os.PathLike, record: dict) -> None:
    """Add one line to the store's run history (the launcher does, under the store's lock)."""
    path = run_dir(store) / RUNS
    path.parent.mkdir(parents=True, exist_ok=True)
    old = path.read_text(encoding="utf-8") if path.is_file() else ""
    line = json.dumps(record, sort_keys=True, default=str) + "\n"
    atomic_write_bytes(path, (old + line).encode(), durable=False)


def read_runs(store: str | os.PathLike) -> list[dict]:
    path = run_dir(store) / RUNS
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text(encoding="utf-8").split("\n") if x.strip()]


def forget(store: str | os.PathLike) -> None:
    """Delete the record of a store that is being deleted (--overwrite): a new store starts a new history."""
    import shutil

    shutil.rmtree(run_dir(store), ignore_errors=True)


__all__ = ["DATA_STATS", "RUN_OPTIONS", "forget", "read_runs", "read_shard_run", "record_run", "run_dir",
           "split_stats", "write_shard_run"]
