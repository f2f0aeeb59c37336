"""User-facing errors.

A `DFlashError` is a problem with the user's input or environment (a missing file, a malformed line, a
store that does not match the target).  The command line prints its message as one paragraph and exits
non-zero without a traceback; anything else is a bug and keeps its traceback.
"""


class DFlashError(Exception):
    """An error the user can fix; the message says what is wrong, where, and what to do."""


class ConfigError(DFlashError):
    """A bad option, params.yaml entry or flag combination."""


class DataError(DFlashError):
    """A dataset that cannot be read or has no usable conversations."""


class TargetError(DFlashError):
    """A target model or tokenizer that cannot be loaded or used."""


class StoreError(DFlashError):
    """A store that is missing, corrupt or does not match what the caller needs."""


class LockedError(DFlashError):
    """A store or run directory that another live command is writing (dflash/locks.py)."""
