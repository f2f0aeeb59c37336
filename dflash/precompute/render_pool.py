"""Rendering a shard's rows (chat template, tokenizer, loss mask) ahead of the capture, in worker processes.

For a small target the GPU captures faster than one CPU core renders, and rendered inline the two add up.
So a shard hands its windows of rows to a few worker processes and renders the
next windows while the GPU captures this one.  Workers render the same rows with the same tokenizer as
the shard would: the samples, the batch plan and therefore the store are the same with any number of
workers, including none (inline, what CPU runs and tests use).  Workers are spawned (never forked: the
shard holds a CUDA context) and die with their shard (`spawned.die_with_parent`).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator

from dflash.chat import Rendered, conversation_of, load_rows, render
from dflash.spawned import die_with_parent

AHEAD = 2  # windows rendered ahead of the one being captured: enough to hide rendering, bounded memory
PIECES_PER_WORKER = 4  # a window is split so that uneven conversation lengths still keep every worker busy

_worker: dict = {}


def auto_workers(device_type: str, num_shards: int) -> int:
    """On a GPU, the host's cores shared among the shards, less two for the shard's own thread and its
    writer process, at most 8; on the CPU, none (the cores are busy with the forward itself)."""
    if device_type != "cuda":
        return 0
    return max(1, min(8, (os.cpu_count() or 1) // max(num_shards, 1) - 2))


def _init(parent_pid: int, target: str, trust_remote_code: bool, data: str, split: str, max_samples,
          skip_bad_lines: bool) -> None:
    from dflash.target_model.capture import load_tokenizer

    die_with_parent(parent_pid)
    _worker["tokenizer"] = load_tokenizer(target, trust_remote_code)
    _worker["rows"] = load_rows(data, split, max_samples, check=False, skip_bad_lines=skip_bad_lines)
    _worker["data"] = data


def _render(tok, ds, data: str, rows: list[int], max_length: int) -> list[tuple[int, Rendered]]:
    return [(r, render(tok, conversation_of(ds[r], r, data), max_length, where=f"dataset {data}, row {r}")) for r in rows]


def _render_rows(rows: list[int], max_length: int) -> list[tuple[int, Rendered]]:
    return _render(_worker["tokenizer"], _worker["rows"], _worker["data"], rows, max_length)


class RenderPool:
    """`windows(rows)` yields, window by window and in order, [(row, Rendered)] for every row."""

    def __init__(self, cfg, tokenizer, ds, workers: int, window: int):
        self.cfg, self.tokenizer, self.ds, self.window = cfg, tokenizer, ds, window
        self.workers = workers
        self.pool = None
        if workers > 0:
            import multiprocessing as mp

            self.pool = mp.get_context("spawn").Pool(
                workers, initializer=_init,
                initargs=(os.getpid(), cfg.target, cfg.trust_remote_code, cfg.data, cfg.split, cfg.max_samples,
                          cfg.skip_bad_rows))

    def __enter__(self) -> RenderPool:
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()

    def _submit(self, window: list[int]):
        n = max(1, -(-len(window) // (self.workers * PIECES_PER_WORKER)))
        pieces = [window[i : i + n] for i in range(0, len(window), n)]
        return [self.pool.apply_async(_render_rows, (p, self.cfg.max_length)) for p in pieces]

    def windows(self, rows: list[int]) -> Iterator[list[tuple[int, Rendered]]]:
        starts = range(0, len(rows), self.window)
        if self.pool is None:
            for w0 in starts:
                yield _render(self.tokenizer, self.ds, self.cfg.data, rows[w0 : w0 + self.window], self.cfg.max_length)
            return
        pending: deque = deque()
        for w0 in starts:
            pending.append(self._submit(rows[w0 : w0 + self.window]))
            if len(pending) > AHEAD:
                yield [x for piece in pending.popleft() for x in piece.get()]
        while pending:
            yield [x for piece in pending.popleft() for x in piece.get()]
