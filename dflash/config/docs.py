"""docs/OPTIONS.md, generated from the fields' help: `python -m dflash.config > docs/OPTIONS.md`."""

from __future__ import annotations

import dataclasses

from dflash.config.load import SECTIONS, options_of
from dflash.config.train import SECTION_TYPES, TrainConfig
from dflash.fields import choices_of, show_default


def _table(cls: type, names: list[str]) -> list[str]:
    options = options_of(cls)
    lines = ["| option | default | meaning |", "| --- | --- | --- |"]
    for name in names:
        o = options[name]
        choices = choices_of(o.type)
        text = o.field.metadata.get("help", "") + (f" One of: {', '.join(choices)}." if choices else "")
        lines.append(f"| `{name}` (`--{name.replace('_', '-')}`) | `{show_default(o.field)}` | {text} |")
    return lines


def options_markdown() -> str:
    """docs/OPTIONS.md: every option of every command, from the fields' help (tests check it is current)."""
    lines = ["# Options", "", "Generated from dflash/config/ by `python -m dflash.config > docs/OPTIONS.md`; "
             "a test checks it is current.", "", "Each command reads its section of `params.yaml` (`--config`, "
             "default `./params.yaml` when present); a flag given on the command line wins. `train`'s options are "
             "grouped in sections, and params.yaml may write them nested (`train: {optim: {lr: 0.0006}}`) or flat "
             "(`train: {lr: 0.0006}`); on the command line they are flat (`--lr`).", ""]
    for cls, section in SECTIONS.items():
        lines += [f"## `{section}`", "", (cls.__doc__ or "").strip(), ""]
        if cls is TrainConfig:
            for name, group in SECTION_TYPES.items():
                lines += [f"### `train.{name}`", "", (group.__doc__ or "").strip(), ""]
                lines += _table(cls, [f.name for f in dataclasses.fields(group)]) + [""]
        else:
            lines += _table(cls, list(options_of(cls))) + [""]
    return "\n".join(lines)


__all__ = ["options_markdown"]
