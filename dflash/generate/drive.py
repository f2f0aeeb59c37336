"""The rows still to do through an engine, window by window, each row appended to a journal once its turns are done.

One device or a server: in this process.  Several GPUs: one spawned process per GPU (as precompute
does), each taking every N-th row left and appending to a journal of its own; the launcher only draws
the progress bar from their reports.  A row's turns are generated in order (`--turns all`: each one
after the target's own earlier ones); a window's rows advance turn by turn together, so that each round
is one batch of requests.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

from tqdm import tqdm

from dflash.errors import DFlashError, GenerateError
from dflash.generate.journal import Journal
from dflash.generate.local import Request
from dflash.generate.rows import Plan, apply_response, prompt_messages, write_back
from dflash.spawned import die_with_parent, raise_failure, supervise


def make_engine(cfg, device: str | None):
    if cfg.endpoint:
        from dflash.generate.endpoint import EndpointEngine

        return EndpointEngine(cfg)
    from dflash.generate.local import LocalEngine

    return LocalEngine(cfg, device or "cpu")


def by_prompt_length(todo: list[Plan], length) -> list[Plan]:
    """The rows in order of their first prompt's length (`length(messages)`, the engine's tokens; ties by
    row), for the in-process engine: a window then holds prompts of one length class, so its batches pad
    little and, with the static cache, keep one width, one cache and one set of CUDA graphs from batch to
    batch. In file order a window mixes short and long prompts and the width falls back at every window
    (DESIGN §10). The output is assembled by row, so the order changes no file."""
    return sorted(todo, key=lambda p: (length(p.messages[:p.turns[0]]) if p.turns else 0, p.row))


def window_size(cfg) -> int:
    return max(cfg.concurrency, 1) * 4 if cfg.endpoint else max(cfg.batch_size, 1) * 4


def run_window(engine, cfg, rows: list[dict], chunk: list[Plan], emit=None) -> list[dict]:
    """Journal records of the window's rows: every planned turn generated, in order.  With `emit`, each
    row's record goes to `emit` as soon as its last turn is generated (a batch at a time from an engine
    that reports batches, a round at a time otherwise); the records not emitted are returned."""
    plans = {p.row: p for p in chunk}
    convs = {p.row: p.messages for p in chunk}
    pending = {p.row: list(p.turns) for p in chunk}
    acc = {p.row: {"tokens": 0, "cut": 0, "failed": None} for p in chunk}
    sent: set[int] = set()

    def record(r: int) -> dict:
        return {"row": r, "out": None if acc[r]["failed"] else write_back(rows[r], plans[r], convs[r]), **acc[r]}

    def take(responses) -> None:
        for resp in responses:
            turn = pending[resp.key].pop(0)
            if resp.error is not None:
                acc[resp.key]["failed"] = resp.error
                pending[resp.key] = []
                continue
            convs[resp.key] = apply_response(convs[resp.key], turn, resp.text)
            acc[resp.key]["tokens"] += resp.tokens
            acc[resp.key]["cut"] += int(resp.cut)
        if emit is not None:
            done = [resp.key for resp in responses if not pending[resp.key] and resp.key not in sent]
            sent.update(done)
            emit([record(r) for r in done])

    by_batch = emit is not None and getattr(engine, "reports_batches", False)
    while True:
        reqs = [Request(r, prompt_messages(convs[r], turns[0])) for r, turns in pending.items() if turns]
        if not reqs:
            break
        if by_batch:
            engine.generate(reqs, cfg.seed, on_batch=take)
        else:
            take(engine.generate(reqs, cfg.seed))
    return [record(p.row) for p in chunk if p.row not in sent]


def drive(engine, cfg, rows, todo: list[Plan], journal: Journal, report, ordered: bool = True) -> None:
    """`report(rows, tokens)` each time finished rows are in the journal: in process, a batch at a time (with
    continuous batching, as rows finish), so a stopped or killed run loses at most the rows in flight.  An engine that measures prompts in tokens
    (in-process) takes the rows shortest first unless `ordered` is False."""
    if ordered and hasattr(engine, "prompt_length"):
        # in tokens: characters put a code or non-Latin prompt in a window of short ones (a width of
        # 2,048 among 64s), which sends the width back at the next window
        todo = by_prompt_length(todo, engine.prompt_length)

    def emit(records: list[dict]) -> None:
        if records:
            journal.append(records)
            report(len(records), sum(r["tokens"] for r in records))

    size = getattr(engine, "window_rows", None) or window_size(cfg)
    for w in range(0, len(todo), size):
        emit(run_window(engine, cfg, rows, todo[w:w + size], emit))
    journal.sync()


class Bar:
    """tqdm over rows, with tokens/s of this run beside rows/s."""

    def __init__(self, total: int, initial: int):
        self.t0, self.tokens = time.time(), 0
        self.bar = tqdm(total=total, initial=initial, unit="row", desc="generate", dynamic_ncols=True,
                        file=sys.stderr, mininterval=0.5)

    def __call__(self, rows: int, tokens: int) -> None:
        self.tokens += tokens
        self.bar.set_postfix_str(f"{self.tokens / max(time.time() - self.t0, 1e-9):.0f} tokens/s", refresh=False)
        self.bar.update(rows)

    def close(self) -> None:
        self.bar.close()


def generate_rows(cfg, work, rows: list[dict], todo: list[Plan], resumed: int) -> None:
    if cfg.turns == "none":  # nothing to generate: no model, no server
        journal = Journal(work, 0)
        journal.append([{"row": p.row, "out": write_back(rows[p.row], p, p.messages), "tokens": 0, "cut": 0,
                         "failed": None} for p in todo])
        journal.close()
        return
    devices = [None]
    if not cfg.endpoint:
        from dflash.generate.local import devices as local_devices
        from dflash.generate.local import static_cache_note

        devices = local_devices(cfg.gpus)
        if devices == ["cpu"]:
            print("generate: running in-process on CPU (no GPU requested or available).", flush=True)
        note = static_cache_note(cfg.static_cache, devices, len(todo), cfg.continuous_batching)
        if note:
            print(note, flush=True)
    bar = Bar(len(rows), resumed)
    try:
        if len(devices) == 1:
            engine = make_engine(cfg, devices[0])
            journal = Journal(work, 0)
            try:
                drive(engine, cfg, rows, todo, journal, bar)
            finally:
                journal.close()
        else:
            _spawn(cfg, work, rows, todo, devices, bar)
    finally:
        bar.close()


def _worker(cfg, work, rows, todo, shard: int, device: str, queue, parent_pid: int) -> None:
    die_with_parent(parent_pid)  # a killed `dflash generate` leaves no process appending to its journal
    try:
        engine = make_engine(cfg, device)
        journal = Journal(work, shard)
        try:
            drive(engine, cfg, rows, todo, journal, lambda n, t: queue.put(("progress", shard, (n, t))))
        finally:
            journal.close()
        queue.put(("ok", shard, None))
    except DFlashError as e:
        queue.put(("user", shard, str(e)))
        sys.exit(1)
    except BaseException:
        queue.put(("bug", shard, traceback.format_exc()))
        sys.exit(1)


def _spawn(cfg, work, rows, todo, devices: list[str], bar: Bar) -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    n = len(devices)
    procs = {k: ctx.Process(target=_worker, args=(cfg, work, rows, todo[k::n], k, d, queue, os.getpid()))
             for k, d in enumerate(devices)}
    for p in procs.values():
        p.start()
    failure = supervise(procs, queue, on_message=lambda kind, shard, payload: bar(*payload))
    if failure is not None:
        raise_failure(failure, f"generate process {failure[1]} ({devices[failure[1]]})",
                      "The rows finished so far are kept: rerun the same command to continue.", GenerateError)

__all__ = ["generate_rows", "drive", "run_window", "make_engine", "by_prompt_length"]
