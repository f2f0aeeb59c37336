"""Durable files for every stage (store, generate, checkpoints, eval outputs): atomic replace, fsyncs, the
leftovers of a killed write, a full disk named."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash.errors import StoreError


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new file in `path` durable (POSIX: the directory entry lives in the directory)."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)


def is_disk_full(e: BaseException) -> bool:
    """ENOSPC / EDQUOT, raised directly or wrapped (zarr and safetensors report it in their own types)."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def disk_full_error(path: str | os.PathLike, e: BaseException) -> StoreError:
    return StoreError(
        f"no space left on the device while writing {path} ({e}). Free space on the filesystem holding "
        f"{Path(path).parent} (or choose an --out on another one) and rerun the same `dflash precompute` "
        "command: it resumes from the last commit, and nothing written after it is used."
    )


def atomic_write_bytes(path: str | os.PathLike, data: bytes | memoryview, durable: bool = True,
                       disk_full: Callable[[Path, BaseException], Exception] = disk_full_error) -> None:
    """Write `path` so that a reader (or a crash at any instant) sees the old file or the new one, never a mix.

    The rename alone is atomic against a killed process; `durable` adds the fsyncs that make it survive
    a power loss too. A full disk raises `disk_full(path, e)`: the error that names what to rerun.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if is_disk_full(e):
            raise disk_full(path, e) from e
        raise
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)


def remove_leftovers(*dirs: str | os.PathLike, prefix: str = ".") -> list[Path]:
    """Delete the `.NAME.tmp-PID` files that a killed atomic_write_bytes left in `dirs` (not recursive), only
    those whose name starts with `prefix` (`.NAME.tmp-` for one file's in a folder that is not dflash's).

    Only a caller holding the lock of what it writes may call it: then no live writer owns such a file.
    """
    gone = []
    for d in map(Path, dirs):
        if d.is_dir():
            for p in d.iterdir():
                if p.name.startswith(prefix) and p.name.startswith(".") and ".tmp-" in p.name and p.is_file():
                    p.unlink(missing_ok=True)
                    gone.append(p)
    return gone


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, json.JSONDecodeError) as e:
        raise StoreError(f"{path} cannot be read ({e}); the store is damaged: rerun precompute with --overwrite.") from None
