"""Whether a new store fits on its disk, asked before anything is written.

A store is mostly its context features: every token's hidden states at the target layers (measured stores
are within a few percent of that raw size; the top-k, ids and index are small beside it, and Blosc gains
little on activations).  The tokens a row renders to are estimated from an even sample of the rows, so the
check costs a fraction of a second however large the dataset.  It is a floor, not a promise: a run it lets
through can still fill a disk shared with other writers, and that still ends with precompute's one-paragraph
error and a resumable store."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from dflash.chat import conversation_of, render
from dflash.errors import DFlashError

SAMPLE_ROWS = 200
FEATURE_BYTES = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}


def feature_bytes_per_token(hidden_size: int, num_layers: int, hidden_dtype: str, final_hidden: bool) -> int:
    """Raw bytes of one token's context features (and its final hidden state, when the store keeps it)."""
    return hidden_size * (num_layers + int(final_hidden)) * FEATURE_BYTES.get(hidden_dtype, 2)


def tokens_per_row(tokenizer, ds, rows: np.ndarray, data, max_length: int) -> float:
    """The mean stored tokens of `rows` (each cut at max_length), from up to SAMPLE_ROWS spread evenly."""
    picked = rows[np.unique(np.linspace(0, len(rows) - 1, min(len(rows), SAMPLE_ROWS)).astype(np.int64))]
    lengths = [n for n in (_tokens(tokenizer, ds, int(r), data, max_length) for r in picked) if n is not None]
    return float(np.mean(lengths)) if lengths else 0.0


def _tokens(tokenizer, ds, row: int, data, max_length: int) -> int | None:
    try:
        return len(render(tokenizer, conversation_of(ds[row], row, data), max_length,
                          where=f"dataset {data}, row {row}").input_ids)
    except DFlashError:  # a row that does not render is the row checks' and the shard's to report, not an estimate's
        return None


def free_bytes(out: Path) -> int:
    """Free bytes where `out` will be written (its nearest existing folder)."""
    p = Path(out).absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def space_problem(out: Path, num_rows: int, mean_tokens: float, bytes_per_token: int) -> str | None:
    """None when the store's features fit beside what is free at `out`, else what to do, with the numbers."""
    need = num_rows * mean_tokens * bytes_per_token
    free = free_bytes(out)
    if need <= free:
        return None
    gb = lambda b: f"{b / 1e9:,.1f} GB"  # noqa: E731
    return (f"store {out} would not fit: its {num_rows:,} conversations render to about {mean_tokens:,.0f} tokens "
            f"each (a sample of {min(num_rows, SAMPLE_ROWS)}) and their context features take "
            f"{bytes_per_token:,} bytes a token, about {gb(need)}, where {gb(free)} is free. Free space or "
            "choose an --out on a larger disk; fewer bytes a token (--hidden-dtype fp8), a lower --max-length "
            "or fewer conversations make the store smaller; --no-space-check captures anyway.")
