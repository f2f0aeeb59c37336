"""Paths as the files dflash writes record them: relative to the directory a record describes (a store's
dataset and target in its manifest, a run's store in its config), so that a store or run directory shared
with other users or moved together with its inputs carries no absolute path of the machine it was made on
(docs/DESIGN.md §8).  Option values the user typed are recorded as typed."""

from __future__ import annotations

import os
from pathlib import Path


def portable(path: str | os.PathLike, base: str | os.PathLike) -> str:
    """`path` relative to the directory `base` (which need not exist yet)."""
    return os.path.relpath(os.path.abspath(path), os.path.abspath(base))


def from_record(recorded: str | os.PathLike | None, base: str | os.PathLike) -> Path | None:
    """A path read back from a record made by `portable` (or an absolute one)."""
    if not recorded:
        return None
    p = Path(recorded)
    return p if p.is_absolute() else Path(os.path.normpath(Path(base) / p))
