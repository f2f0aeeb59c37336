"""Supervising the spawned processes of a stage (precompute's shards, generate's devices).

Each child reports `(kind, key, payload)` on a queue: "ok", "user" (a DFlashError's message) or "bug" (a
traceback) once, when it ends, and any other kind (progress) on the way.  The parent waits for every
child, and at the first failure (a report other than "ok", or a child that exited without reporting)
stops the others, so that a run never goes on with a shard or device missing.
"""

from __future__ import annotations

import sys
import time

ENDS = ("ok", "user", "bug")


def supervise(procs: dict, queue, on_message=None) -> tuple | None:
    """Wait for `procs` ({key: started process}); returns None when all reported "ok", else the first
    failure as (kind, key, payload), kind "user", "bug" or "died".  Other reports go to
    `on_message(kind, key, payload)`."""
    finished: set = set()
    failure = None
    try:
        while len(finished) < len(procs) and failure is None:
            while not queue.empty():
                kind, key, payload = queue.get()
                if kind not in ENDS:
                    if on_message is not None:
                        on_message(kind, key, payload)
                    continue
                finished.add(key)
                if kind != "ok":
                    failure = failure or (kind, key, payload)
            for key, p in procs.items():
                if key not in finished and p.exitcode is not None and queue.empty():
                    failure = failure or ("died", key, f"exit code {p.exitcode}")
                    finished.add(key)
            time.sleep(0.05)
    finally:
        for p in procs.values():
            if p.is_alive() and (failure is not None or sys.exc_info()[0] is not None):
                p.terminate()
            p.join()
    return failure


def raise_failure(failure: tuple | None, who: str, died: str, died_error: type | None = None) -> None:
    """Raise what supervise()'s `failure` means (nothing when None): a "user" failure as the DFlashError its
    child reported, a child that died as `died_error` (DFlashError by default) ending with the advice
    `died`, a "bug" as a RuntimeError with the child's traceback.  `who` names the child, e.g. "shard 3"."""
    from dflash.errors import DFlashError

    if failure is None:
        return
    kind, _, payload = failure
    if kind == "user":
        raise DFlashError(f"{who} failed: {payload}")
    if kind == "died":
        raise (died_error or DFlashError)(f"{who} died ({payload}; out of memory?). {died}")
    raise RuntimeError(f"{who} failed with an unexpected error:\n{payload}")


def die_with_parent(parent_pid: int | None = None) -> None:
    """Make this spawned process end when its parent (the command that started it, which holds the
    stage's lock, dflash/locks.py) dies, even by SIGKILL: the kernel sends this process SIGKILL then
    (Linux `PR_SET_PDEATHSIG`).  A killed launcher thus never leaves processes writing a run or store
    whose lock it released.  If the parent is no longer `parent_pid` (it died already), exit now.
    Elsewhere, a no-op."""
    import os
    import signal

    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    if parent_pid is not None and os.getppid() != parent_pid:  # died before the call above took effect
        os._exit(1)


def pid_alive(pid: int) -> bool:
    """`pid` runs (a zombie, killed but not yet reaped, does not)."""
    import os

    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: existence only
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


__all__ = ["supervise", "raise_failure", "die_with_parent", "pid_alive"]
