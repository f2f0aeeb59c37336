"""JSON lines end at "\\n" only.

`str.splitlines` also breaks at U+2028, U+2029, \\x85, \\x0b, \\x0c and \\x1c-\\x1e, which a JSON string may
hold raw (json.dumps(..., ensure_ascii=False) writes U+2028, U+2029 and \\x85 as they are), so a valid
record would be cut in two.  A trailing "\\r" (a file written on Windows) is dropped.
"""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T", str, bytes)


def jsonl_lines(data: T) -> list[T]:
    """The lines of JSON-lines text or bytes, without their terminators; a final "\\n" opens no empty line."""
    nl, cr = ("\n", "\r") if isinstance(data, str) else (b"\n", b"\r")
    parts = data.split(nl)
    if parts and not parts[-1]:
        parts.pop()
    return [p[:-1] if p.endswith(cr) else p for p in parts]


__all__ = ["jsonl_lines"]
