"""Resumption for `dflash generate`: an append-only journal of finished rows, and the output assembled from it.

    <dir>/<name>                      the output, written once, whole, by an atomic rename
    <dir>/.<name>.generate/run.meta   the inputs the journals belong to (JSON), written atomically first
    <dir>/.<name>.generate/shard-NNNNN.journal
                                      one JSON object per finished row, appended by one process each

A row is finished once its line, newline included, is in the journal.  A `kill -9` can only leave the
last line of a journal torn (appends are sequential); it is cut off when the journal is reopened, and
only that row is generated again.  The output is rebuilt from the journals in row order, so it is the
same bytes whatever the interruptions and whichever process finished which row.  The file names end
neither in .json nor .jsonl, so a directory holding the output can still be given to `--data`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from dflash import durable
from dflash.durable import atomic_write_bytes
from dflash.errors import GenerateError
from dflash.jsonl import jsonl_lines

META = "run.meta"


def work_dir(out: str | os.PathLike) -> Path:
    p = Path(os.path.abspath(out))
    return p.with_name(f".{p.name}.generate")


def _disk_error(path: Path, e: OSError) -> GenerateError:
    return GenerateError(
        f"cannot write {path} ({e.strerror or e}); free space or fix permissions there, then rerun the same "
        "command: finished rows are kept."
    )


def atomic_write(path: Path, data: bytes) -> None:
    """Readers and crashes see the old file or the new one, never a part."""
    try:
        atomic_write_bytes(path, data, disk_full=_disk_error)
    except OSError as e:
        raise _disk_error(path, e) from None


def remove_leftovers(out: Path, work: Path) -> None:
    """What a run killed inside atomic_write left beside `out` (this output's only: the folder is the
    user's) and in the journal directory. Called under the output's lock."""
    durable.remove_leftovers(out.parent, prefix=f".{out.name}.tmp-")
    durable.remove_leftovers(work)


def read_meta(work: Path) -> dict | None:
    try:
        return json.loads((work / META).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise GenerateError(f"{work / META} cannot be read ({e}); delete {work} to start over.") from None


def write_meta(work: Path, meta: dict) -> None:
    work.mkdir(parents=True, exist_ok=True)
    atomic_write(work / META, (json.dumps(meta, indent=1, sort_keys=True) + "\n").encode())


def _scan(path: Path) -> tuple[list[dict], int]:
    """The complete records of a journal and the byte length they span (a torn last line excluded)."""
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    records = []
    for lineno, line in enumerate(jsonl_lines(data[:end]), 1):
        try:
            rec = json.loads(line)
            int(rec["row"])
        except (ValueError, KeyError, TypeError):
            raise GenerateError(
                f"journal {path}, line {lineno}, is damaged (a complete line that is not a row record: the "
                "file was changed by something other than dflash); delete that line or the directory "
                f"{path.parent} to generate those rows again."
            ) from None
        records.append(rec)
    return records, end


def load_records(work: Path) -> dict[int, dict]:
    """Every row finished in any journal of `work` (read-only: torn tails are ignored, not cut)."""
    done: dict[int, dict] = {}
    for path in sorted(work.glob("shard-*.journal")):
        for rec in _scan(path)[0]:
            done[int(rec["row"])] = rec
    return done


class Journal:
    """One process's journal: reopened with its torn tail cut off, then appended to."""

    def __init__(self, work: Path, shard: int):
        self.path = work / f"shard-{shard:05d}.journal"
        try:
            if self.path.exists():
                _, end = _scan(self.path)
                if end != self.path.stat().st_size:
                    os.truncate(self.path, end)  # the row being written when the last run died
            self._f = open(self.path, "ab")
        except OSError as e:
            raise _disk_error(self.path, e) from None

    def append(self, records: list[dict]) -> None:
        """One write for the batch: once it returns the rows survive the process being killed."""
        if not records:
            return
        data = b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in records)
        try:
            self._f.write(data)
            self._f.flush()
        except OSError as e:
            raise _disk_error(self.path, e) from None

    def sync(self) -> None:
        """fsync: the rows also survive a power loss (kill -9 needs only the flushed write)."""
        try:
            os.fsync(self._f.fileno())
        except OSError as e:
            raise _disk_error(self.path, e) from None

    def close(self) -> None:
        if not self._f.closed:
            self.sync()
            self._f.close()


def output_bytes(records: dict[int, dict], num_rows: int) -> bytes:
    """The output file: finished rows in dataset order, one JSON object per line; failed rows left out."""
    lines = []
    for i in range(num_rows):
        rec = records.get(i)
        if rec is not None and rec.get("out") is not None:
            lines.append(json.dumps(rec["out"], ensure_ascii=False).encode() + b"\n")
    return b"".join(lines)


def assemble(out: Path, records: dict[int, dict], num_rows: int) -> str:
    """Write the output atomically; return its sha256."""
    data = output_bytes(records, num_rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, data)
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


__all__ = ["work_dir", "remove_leftovers", "read_meta", "write_meta", "load_records", "Journal", "assemble", "output_bytes",
           "file_sha256", "atomic_write"]
