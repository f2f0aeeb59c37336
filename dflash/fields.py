"""A config field and its value: `opt` (the help text, written once), the `Literal` choices, and the
coercion of a YAML or command-line value into the field's type.  Every group of options is written with
them: the commands' (dflash.config) and the drafter families' own sections (dflash.drafter.<family>).

Choices are the field's type (`Literal["ddp", "fsdp"]`); `Options.__post_init__` checks them when any
config is built, from params.yaml, flags or Python, and `coerce` checks them with the value's origin.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import field
from typing import Any, Literal

from dflash.errors import ConfigError


def opt(default: Any = None, help: str = "") -> Any:
    """A config field with its help text, written once: `dflash <command> --help`, docs/OPTIONS.md and
    params.yaml's documentation all read it from here."""
    meta = {"help": help}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


AutoOnOff = Literal["auto", "on", "off"]
AutoDtype = Literal["auto", "bf16", "fp32"]


def _non_none(tp: Any) -> Any:
    """`X | None` -> X; anything else as it is."""
    base = typing.get_origin(tp)
    if base is typing.Union or (base is not None and str(base) == "<class 'types.UnionType'>"):
        return [a for a in typing.get_args(tp) if a is not type(None)][0]
    return tp


def choices_of(tp: Any) -> tuple[str, ...] | None:
    """The values a `Literal[...]` field (or `Literal[...] | None`) may take; None for any other type."""
    tp = _non_none(tp)
    return tuple(typing.get_args(tp)) if typing.get_origin(tp) is Literal else None


def check_choice(name: str, tp: Any, value: Any, origin: str) -> Any:
    """The one check of a field's choices."""
    choices = choices_of(tp)
    if choices and value is not None and value not in choices:
        raise ConfigError(f"{origin}: `{name}` = {value!r} is not one of {', '.join(choices)}; pick one of them.")
    return value


def coerce(name: str, tp: Any, value: Any, origin: str) -> Any:
    """Turn a YAML or command-line value into the field's type, or say which key is wrong."""
    if value is None:
        return None
    tp = _non_none(tp)
    args = typing.get_args(tp)
    base = typing.get_origin(tp)
    if base is Literal:
        if isinstance(value, bool) and {"on", "off"} <= set(args):
            value = "on" if value else "off"  # YAML 1.1 reads an unquoted on/off as a boolean
        return check_choice(name, tp, str(value) if not isinstance(value, bool) else value, origin)
    try:
        if base is list:
            if isinstance(value, str):
                value = [v for v in value.replace(" ", "").split(",") if v]
            return [coerce(name, args[0], v, origin) for v in value]
        if base is tuple:
            if isinstance(value, str):
                value = value.replace(" ", "").split(",")
            return tuple(coerce(name, a, v, origin) for a, v in zip(args, value))
        if tp is bool:
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            return bool(value)
        if tp is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if tp is float:
            return float(value)
        if tp is str:
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"{origin}: `{name}` = {value!r} is not a valid {getattr(tp, '__name__', tp)}; fix the value."
        ) from None
    return value


class Options:
    """Base of every group of options (a command's config, or a section of `dflash train`'s): its
    `Literal` fields are checked when it is built, whoever builds it."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            check_choice(f.name, hints[f.name], getattr(self, f.name), type(self).__name__)

    def rules(self) -> list[tuple[bool, str]]:
        """(holds, message) of each rule across this group's fields; checked before the command runs."""
        return []


def check_rules(rules: list[tuple[bool, str]]) -> None:
    for ok, message in rules:
        if not ok:
            raise ConfigError(message)


def show_default(f: dataclasses.Field) -> str:
    d = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    if d is None or d == "":
        return "-"
    if isinstance(d, (list, tuple)):
        return ",".join(map(str, d))
    return str(d).lower() if isinstance(d, bool) else str(d)


__all__ = ["AutoDtype", "AutoOnOff", "Options", "check_choice", "check_rules", "choices_of", "coerce", "opt", "show_default"]
