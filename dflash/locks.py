"""One writer per store, one trainer per run directory: locks that a crash cannot leave behind.

    with dir_lock(out, "store", "--out"):      # refused at once, naming the holder, when another holds it
        ...                                   # delete, create and write `out`

The lock is an `fcntl.flock` on a file beside the directory, `<parent>/.<name>.dflash.lock`, never in
it: `--overwrite` deletes the directory, and a lock inside it would be deleted from under its holder.
It is taken before anything is deleted or created.  The kernel drops a flock when its holder's last
file descriptor closes, which a `kill -9` does too, so a dead holder never blocks: the next command
takes the lock over.  The holder writes `{host, pid, since, argv}` as JSON into the file, only for the
refusal's message; the flock alone decides who holds it.  A clean release deletes the file (an
acquirer that locked a file deleted meanwhile retries on the new one).

The descriptor is not inheritable (PEP 446): spawned children (shard processes, training processes)
do not hold the lock; the command that took it holds it for the whole run, and they die with it
(`spawned.die_with_parent`), so a killed launcher never leaves a process writing what it locked.

flock is per host.  Across machines it only excludes where the shared filesystem implements it (NFSv4,
Lustre with `-o flock`, CephFS, GPFS do; NFSv3 without lockd, some FUSE and object-store mounts do
not: there two hosts can both "hold" the lock).  Local filesystems always do.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

from dflash.errors import DFlashError, LockedError


def lock_path(directory: str | os.PathLike) -> Path:
    """`<parent>/.<name>.dflash.lock`: beside the directory, so that deleting it leaves the lock."""
    d = Path(os.path.abspath(directory))
    return d.with_name(f".{d.name}.dflash.lock")


def read_holder(path: str | os.PathLike) -> dict:
    """What the holder wrote into the lock file ({} when unreadable or being written)."""
    try:
        info = json.loads(Path(path).read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _describe(info: dict) -> str:
    if not info:
        return "another process (it has not written its name yet)"
    argv = info.get("argv") or []
    cmd = " ".join(str(a) for a in argv) if isinstance(argv, list) else str(argv)
    return (f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, since {info.get('since', '?')}, "
            f"running `{cmd}`")


def _open_locked(path: Path) -> int | None:
    """An fd holding the flock of the file now at `path`, or None when a live process holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return None
            raise
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # the holder released and deleted this file after we opened it: lock the new one


@contextlib.contextmanager
def dir_lock(directory: str | os.PathLike, what: str, flag: str = "--out") -> Iterator[Path]:
    """Hold the lock of `directory` (a store or a run directory, named `what` in messages) for the block.

    Raises LockedError at once, naming the holder's host, pid, start time and command, when a live
    process holds it.  The parent directory is created when missing (the lock file lives there).
    """
    d = Path(os.path.abspath(directory))
    path = lock_path(d)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = _open_locked(path)
    except OSError as e:
        raise DFlashError(
            f"cannot create the lock file {path} of {what} {d} ({e.strerror or e}); {flag} must be in a "
            "writable directory."
        ) from None
    if fd is None:
        raise LockedError(
            f"{what} {d} is in use by {_describe(read_holder(path))} (lock file {path}). Only one command may "
            f"write a {what} at a time: wait for that one to finish or stop it, or choose another {flag}. If "
            "that process is gone, rerun: a dead holder's lock is taken over."
        )
    info = {"host": socket.gethostname(), "pid": os.getpid(),
            "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "argv": list(sys.argv),
            "directory": str(d)}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)  # still holding it: no one else can be using this file
        os.close(fd)


__all__ = ["LockedError", "dir_lock", "lock_path", "read_holder"]
