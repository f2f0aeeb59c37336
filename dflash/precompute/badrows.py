"""`precompute --skip-bad-rows`: where a row left out came from, and the report that lists them.

A row is bad when dflash cannot use it: an unknown format or role, a content that is not text, a chat
template that refuses the conversation, an assistant reply not found in the render (dflash.errors.RowError).
A line that is not JSON is not a row: `datasets` cannot read the file at all, so it still stops the run.

`STORE/skipped_rows.jsonl` holds one JSON object per skipped row, {part, row, file, line, kind, reason},
ordered by part then row.  It is written before the part that leaves the rows out is recorded (grow.py),
each time from the rows of the parts before it plus this part's, so a rerun after a crash between the two
writes rewrites the same file.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash.chat import data_files
from dflash.jsonl import jsonl_lines
from dflash.store.durable import atomic_write_bytes

REPORT = "skipped_rows.jsonl"


def row_locator(path: str | Path):
    """A function of a dataset row giving {file, line} for rows of JSON-lines files ({file} for a single
    file of another kind, {} for a saved dataset): rows are the files' non-blank lines, in file order."""
    files = data_files(path)
    spans = []  # (file, first row, line number of each row or None)
    first = 0
    for f in files:
        if f.suffix == ".jsonl" or (f.suffix == ".json" and not _is_one_document(f)):
            lines = [n for n, line in enumerate(jsonl_lines(f.read_text(encoding="utf-8")), 1) if line.strip()]
            spans.append((str(f), first, lines))
            first += len(lines)
        else:
            spans.append((str(f), first, None))

    def locate(row: int) -> dict:
        for f, start, lines in reversed(spans):
            if row >= start:
                if lines is None:
                    return {"file": f} if len(spans) == 1 else {}
                return {"file": f, "line": lines[row - start]} if row - start < len(lines) else {}
        return {}

    return locate


def _is_one_document(f: Path) -> bool:
    try:
        json.loads(f.read_text(encoding="utf-8"))
        return True
    except ValueError:
        return False


def write_report(store: str | Path, part: int, records: list[dict]) -> None:
    """Replace the report's rows of `part` and later parts by `records` (atomically); nothing to write
    when neither has any."""
    path = Path(store) / REPORT
    kept = []
    if path.is_file():
        kept = [r for r in map(json.loads, jsonl_lines(path.read_text(encoding="utf-8"))) if r.get("part", 0) < part]
    elif not records:
        return
    rows = kept + [{"part": part, **r} for r in records]
    atomic_write_bytes(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode())


def kinds(records: list[dict]) -> dict[str, int]:
    """Skipped rows counted by reason, most frequent first."""
    out: dict[str, int] = {}
    for r in records:
        out[r["kind"]] = out.get(r["kind"], 0) + 1
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


__all__ = ["REPORT", "kinds", "row_locator", "write_report"]
