"""JSON-lines data files: their lines, and the lines that are not one JSON object.

JSON lines end at "\\n" only.

`str.splitlines` also breaks at U+2028, U+2029, \\x85, \\x0b, \\x0c and \\x1c-\\x1e, which a JSON string may
hold raw (json.dumps(..., ensure_ascii=False) writes U+2028, U+2029 and \\x85 as they are), so a valid
record would be cut in two.  A trailing "\\r" (a file written on Windows) is dropped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypeVar

from dflash.errors import DataError, RowError

T = TypeVar("T", str, bytes)


def jsonl_lines(data: T) -> list[T]:
    """The lines of JSON-lines text or bytes, without their terminators; a final "\\n" opens no empty line."""
    nl, cr = ("\n", "\r") if isinstance(data, str) else (b"\n", b"\r")
    parts = data.split(nl)
    if parts and not parts[-1]:
        parts.pop()
    return [p[:-1] if p.endswith(cr) else p for p in parts]


def line_problem(line: str) -> tuple[str, str] | None:
    """(kind, what is wrong) when a non-blank line is not one JSON object; None when it is one.  The kind
    is what `--skip-bad-rows` counts the line's row by."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return "not valid JSON", f"not valid JSON ({e.msg} at column {e.colno})"
    except RecursionError:
        return "not valid JSON", "not valid JSON (nested too deeply)"
    if not isinstance(obj, dict):
        return "not a JSON object", f"a JSON {type(obj).__name__}, expected an object"
    return None


def scan_file(f: Path, skip: bool) -> tuple[int, dict[int, tuple[int, str, str]]]:
    """(rows, broken): the file's rows (its non-blank lines; a one-document .json: its records) and, by
    row of the file, the lines that are not one JSON object: (line number, kind, what is wrong).  Without
    `skip` the first such line stops the run, named: `datasets` only says that parsing failed somewhere."""
    try:
        text = f.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"dataset file {f} cannot be read ({e}); check the file and its permissions.") from None
    if not text.strip():
        raise DataError(f"dataset file {f} is empty; it needs at least one conversation.")
    if f.suffix == ".json" and text.lstrip()[:1] in ("[", "{"):
        try:
            doc = json.loads(text)
            return (len(doc) if isinstance(doc, list) else 1), {}
        except (json.JSONDecodeError, RecursionError):
            pass  # maybe JSON lines under a .json name: the line scan below says where it breaks
    rows, broken = 0, {}
    for lineno, line in enumerate(jsonl_lines(text), 1):
        if not line.strip():
            continue
        problem = line_problem(line)
        if problem is not None:
            kind, what = problem
            if not skip:
                raise DataError(f"dataset file {f}, line {lineno}: {what}; each line must be one JSON object. Fix "
                                "or delete that line.")
            broken[rows] = (lineno, kind, what)
        rows += 1
    return rows, broken


def without_broken_lines(files: list[Path], skip: bool, tmp: str) -> tuple[list[Path], dict[int, RowError]]:
    """The files to load and the broken lines' errors by dataset row.  With `skip`, a file with broken
    lines is loaded from a copy holding `{}` in their place (a row with no fields): every later row
    keeps its number, so the report's rows, an --append's content match and the shards' row ranges all
    see the dataset the same way."""
    out, broken, first = [], {}, 0
    for n, f in enumerate(files):
        if f.suffix not in (".json", ".jsonl"):
            out.append(f)
            continue
        rows, bad = scan_file(f, skip)
        if bad:
            keep = iter(sorted(bad))
            nxt, row, lines = next(keep, None), 0, []
            for line in jsonl_lines(f.read_text(encoding="utf-8")):
                if line.strip():
                    lines.append("{}" if row == nxt else line)
                    nxt = next(keep, None) if row == nxt else nxt
                    row += 1
                else:
                    lines.append(line)
            f = Path(tmp) / f"{n}-{f.stem}.jsonl"
            f.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
            broken.update({first + r: RowError(f"dataset file {files[n]}, line {line} (row {first + r}): {what}; each "
                                               "line must be one JSON object. Fix or delete that line.", kind)
                           for r, (line, kind, what) in bad.items()})
        out.append(f)
        first += rows
    return out, broken


__all__ = ["jsonl_lines", "line_problem", "scan_file", "without_broken_lines"]
