"""precompute's row pre-pass (every row checked before the store exists) and `--skip-bad-rows`: where a
row left out came from, and the report that lists them.

A row is bad when dflash cannot use it: an unknown format or role, a content that is not text, a chat
template that refuses the conversation, an assistant reply not found in the render (dflash.errors.RowError).
A JSON-lines line that is not one JSON object (cut by a crashed writer, a bare value) is a bad row too
(kind "not valid JSON" or "not a JSON object"): dflash.chat.read_rows loads it as a row with no fields,
so the rows after it keep their numbers.

`STORE/skipped_rows.jsonl` holds one JSON object per skipped row, {part, row, file, line, kind, reason},
ordered by part then row.  It is written before the part that leaves the rows out is recorded (grow.py),
each time from the rows of the parts before it plus this part's, so a rerun after a crash between the two
writes rewrites the same file.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from dflash.chat import check_renders, conversation_key, conversation_of, render, row_locator
from dflash.config import PrecomputeConfig
from dflash.durable import atomic_write_bytes
from dflash.errors import DataError, RowError
from dflash.jsonl import jsonl_lines

REPORT = "skipped_rows.jsonl"
CHECK_RENDER_ROWS = 16  # rows fully rendered up front, so a template that cannot be traced fails early
PREPASS_BAR_ROWS = 5000  # the row pre-pass shows a progress bar from this many rows
PARALLEL_ROWS = 8192  # from this many rows the pre-pass checks them in worker processes (prepass_workers)
PIECE_ROWS = 256  # rows a worker checks at a time: pieces small enough that the workers end together


def _check_one(row, i: int, data: str, tokenizer, held) -> tuple[bytes, str]:
    """One row's content key and what it holds: "held" (an --append store has it), "reply" (an assistant
    reply to supervise) or "prompt" (none); RowError when it is bad.  Every row not held renders through
    the chat template (`chat.check_renders`): a shard renders it too, and a refusal must come now."""
    msgs = conversation_of(row, i, data)
    key = conversation_key(msgs)
    if key in held:
        return key, "held"
    check_renders(tokenizer, msgs, f"dataset {data}, row {i}")
    return key, "reply" if any(m["role"] == "assistant" and m["content"].strip() for m in msgs) else "prompt"


def _outcomes(rows: list[tuple[int, dict]], data: str, tokenizer, held) -> list[tuple]:
    """(i, key, what, None) or (i, None, None, (message, kind)) for each (i, row)."""
    out = []
    for i, row in rows:
        try:
            out.append((i, *_check_one(row, i, data, tokenizer, held), None))
        except RowError as e:
            out.append((i, None, None, (str(e), e.kind)))
    return out


_worker: dict = {}


def _init(parent_pid: int, target: str, trust_remote_code: bool, data: str, held) -> None:
    from dflash.spawned import die_with_parent
    from dflash.target_model.capture import load_tokenizer

    die_with_parent(parent_pid)
    _worker.update(tokenizer=load_tokenizer(target, trust_remote_code), held=held, data=data)


def _check_piece(rows: list[tuple[int, dict]]) -> list[tuple]:
    return _outcomes(rows, _worker["data"], _worker["tokenizer"], _worker["held"])


def prepass_workers(num_rows: int) -> int:
    """Worker processes for the pre-pass: none below PARALLEL_ROWS rows or on a host of two cores or fewer
    (starting them costs more than they save), else the host's cores less one for this process, at most 8.
    The pre-pass runs before any shard starts, so the cores are free on a GPU host and a CPU one alike."""
    cores = os.cpu_count() or 1
    return 0 if num_rows < PARALLEL_ROWS or cores <= 2 else min(8, cores - 1)


def _all_outcomes(cfg: PrecomputeConfig, ds, tokenizer, held, workers: int) -> Iterator[tuple]:
    """Every row's outcome in row order: in this process, or from `workers` spawned processes (never
    forked: the caller may hold a CUDA context) that each check a piece of the rows at a time."""
    if workers <= 0:
        for i, row in enumerate(ds):
            yield from _outcomes([(i, row)], cfg.data, tokenizer, held)
        return
    import multiprocessing as mp

    numbered = enumerate(ds)
    pieces = iter(lambda: list(itertools.islice(numbered, PIECE_ROWS)), [])  # the rows travel with their piece
    initargs = (os.getpid(), cfg.target, cfg.trust_remote_code, cfg.data, held)
    with mp.get_context("spawn").Pool(workers, initializer=_init, initargs=initargs) as pool:
        for piece in pool.imap(_check_piece, pieces):
            yield from piece


def check_rows(cfg: PrecomputeConfig, ds, tokenizer, held: set[bytes] = frozenset(),
               broken: dict[int, RowError] | None = None, workers: int | None = None) -> tuple[list, list[dict]]:
    """Before the store exists: every row has a known format and renders through the chat template with
    its assistant replies found (a pre-pass, `chat.check_renders`; rows an --append store already holds
    are skipped), the first rows render in full, and some row has something to supervise.  Returns each
    row's content key (what an append matches conversations on; None for a row --skip-bad-rows leaves
    out) and the rows left out, each with its reason.  `broken`: the rows whose line is not one JSON
    object (dflash.chat.read_rows), bad rows whatever they hold.  `workers`: processes that check the
    rows (default `prepass_workers`); the outcome is the same with any number, none included."""
    broken = broken or {}
    workers = prepass_workers(len(ds)) if workers is None else workers
    seen = {"assistant": 0, "rendered": 0, "supervised": False}
    keys, bad = [], []
    bar = tqdm(total=len(ds), desc="checking rows", unit="row", leave=False, disable=len(ds) < PREPASS_BAR_ROWS)
    for i, key, what, error in _all_outcomes(cfg, ds, tokenizer, held, workers):
        try:
            if i in broken:
                raise broken[i]
            if error is not None:
                raise RowError(*error)
            seen["assistant"] += what != "prompt"
            if what == "reply" and (seen["rendered"] < CHECK_RENDER_ROWS or not seen["supervised"]):
                r = render(tokenizer, conversation_of(ds[i], i, cfg.data), cfg.max_length, where=f"dataset {cfg.data}, row {i}")
                seen["supervised"] = seen["supervised"] or any(r.loss_mask)
                seen["rendered"] += 1
            keys.append(key)
        except RowError as e:
            if not cfg.skip_bad_rows:
                raise RowError(f"{e} Or pass --skip-bad-rows to capture the other rows and list this one in "
                               f"{Path(cfg.out) / REPORT}.", e.kind) from None
            keys.append(None)
            bad.append({"row": i, "kind": e.kind, "reason": str(e)})
        bar.update(1)
    bar.close()
    seen["supervised"] = seen["supervised"] or bool(held)
    if bad:
        locate = row_locator(cfg.data)
        bad = [{"row": b["row"], **locate(b["row"]), "kind": b["kind"], "reason": b["reason"]} for b in bad]
    if not seen["assistant"] or not seen["supervised"]:
        raise DataError(
            f"no sample of dataset {cfg.data} has a supervised token: "
            + ("the data has no assistant turns" if not seen["assistant"] else "the chat template renders no assistant tokens")
            + f" (checked {len(ds)} rows" + (f", {len(bad)} of them bad and skipped" if bad else "") + "). The "
            "drafter learns from assistant tokens only; give conversations with assistant replies, or a target "
            "whose chat template renders them."
        )
    return keys, bad


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


__all__ = ["REPORT", "check_rows", "prepass_workers", "kinds", "row_locator", "write_report"]
