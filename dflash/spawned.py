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


__all__ = ["supervise"]
