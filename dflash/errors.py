"""User-facing errors.

A `DFlashError` is a problem with the user's input or environment (a missing file, a malformed line, a
store that does not match the target).  The command line prints its message as one paragraph and exits
non-zero without a traceback; anything else is a bug and keeps its traceback.
"""


class DFlashError(Exception):
    """An error the user can fix; the message says what is wrong, where, and what to do.

    One raised in a DataLoader worker reaches the training process re-made by torch with the worker's
    whole traceback as its message ("Caught StoreError in DataLoader worker process 0. Original
    Traceback ..."); the original one-paragraph message is kept instead, the traceback text in
    `worker_traceback` (printed by `--debug`)."""

    worker_traceback: str | None = None

    def __init__(self, *args):
        if len(args) == 1 and isinstance(args[0], str) and args[0].startswith(f"Caught {type(self).__name__} "):
            text, marker = args[0], f"{type(self).__module__}.{type(self).__qualname__}: "
            if "\nOriginal Traceback" in text and marker in text:
                self.worker_traceback = text
                args = (text.rsplit(marker, 1)[1].strip(),)
        super().__init__(*args)


class ConfigError(DFlashError):
    """A bad option, params.yaml entry or flag combination."""


class DataError(DFlashError):
    """A dataset that cannot be read or has no usable conversations."""


class RowError(DataError):
    """One dataset row dflash cannot use (its format, a role, a content, the chat template's render);
    `kind` names the reason in a word or two, what `precompute --skip-bad-rows` counts rows by."""

    def __init__(self, message: str, kind: str = "bad row"):
        super().__init__(message)
        self.kind = kind


class TargetError(DFlashError):
    """A target model or tokenizer that cannot be loaded or used."""


class StoreError(DFlashError):
    """A store that is missing, corrupt or does not match what the caller needs."""


class DamagedSampleError(StoreError):
    """One sample whose bytes fail their checksum (`train --skip-damaged` may skip it and count it)."""

    def __init__(self, message: str, shard: str = "", sample_id: int = -1, field: str = ""):
        super().__init__(message)
        self.shard, self.sample_id, self.field = shard, sample_id, field


class GenerateError(DFlashError):
    """`dflash generate`: a server that cannot be reached or refuses, or an output that cannot be written."""


class LockedError(DFlashError):
    """A store or run directory that another live command is writing (dflash/locks.py)."""


# What each command can hold less of at once, for a GPU that ran out of memory.
LESS_AT_ONCE = {
    "generate": "--batch-size or --batch-tokens",
    "precompute": "--token-budget",
    "train": "--rows-per-batch (--grad-accum keeps the tokens an optimizer step) or --token-budget",
    "eval": "--batch-size",
}


def out_of_memory(e: BaseException) -> bool:
    """torch's OutOfMemoryError, told by name: the command line does not import torch (`--help` stays instant)."""
    return type(e).__name__ == "OutOfMemoryError" and type(e).__module__.split(".")[0] == "torch"


def out_of_memory_message(command: str | None, e: BaseException) -> str:
    """One paragraph for a GPU out of memory in `command`: what was asked and what the card had, and what to lower."""
    said = " ".join(str(e).split())
    said = ". ".join(said.split(". ")[:3]).rstrip(".")  # what was asked and what the card had
    less = LESS_AT_ONCE.get(command or "", "the rows or tokens it handles at once")
    return (f"{command}: the GPU ran out of memory ({said}). Rerun the same command with less at once "
            f"({less}), or free the GPU of other processes.")
