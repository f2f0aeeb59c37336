"""Defaults, then the command's section of params.yaml, then the flags given: `build_config`.

Unknown keys in params.yaml are an error (a typo there would otherwise silently do nothing).  `dflash
train`'s section is nested (`train: {optim: {lr: ...}}`) or flat (`train: {lr: ...}`, the layout before
sections), or a mix; a key under the wrong section is refused with the section it belongs to.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import typing
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from dflash.config.stages import EvalConfig, ExportConfig, GenerateConfig, PrecomputeConfig
from dflash.config.train import OWNER, SECTION_TYPES, TrainConfig
from dflash.errors import ConfigError
from dflash.fields import coerce

SECTIONS: dict[type, str] = {
    GenerateConfig: "generate",
    PrecomputeConfig: "precompute",
    TrainConfig: "train",
    EvalConfig: "eval",
    ExportConfig: "export",
}


class Option(NamedTuple):
    """One option of a command as the command line and params.yaml see it: its flat name, the section of
    `dflash train` it lives in (None for the other commands), its dataclass field and its type."""

    name: str
    section: str | None
    field: dataclasses.Field
    type: Any


@cache
def options_of(cls: type) -> dict[str, Option]:
    """Every option of the command config `cls`, by flat name, in the order of the sections and fields."""
    groups = SECTION_TYPES.items() if cls is TrainConfig else [(None, cls)]
    out = {}
    for section, group in groups:
        hints = typing.get_type_hints(group)
        for f in dataclasses.fields(group):
            out[f.name] = Option(f.name, section, f, hints[f.name])
    return out


def default_config_path() -> Path | None:
    p = Path("params.yaml")
    return p if p.is_file() else None


def load_params(path: str | os.PathLike | None) -> dict[str, Any]:
    if path is None:
        return {}
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass an existing params.yaml with --config.")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML ({e}); fix the syntax.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must be a mapping with sections like `precompute:` and `train:`.")
    return data


def flat_section(cls: type, values: dict, where: str) -> dict[str, tuple[str, Any]]:
    """A command's params.yaml section as {flat option name: (the key as written, value)}: nested train
    sections are opened, and a key is refused when unknown, under the wrong section, or given twice."""
    section = SECTIONS[cls]
    options = options_of(cls)
    out: dict[str, tuple[str, Any]] = {}

    def put(key: str, value: Any, spelled: str) -> None:
        if key in out:
            raise ConfigError(f"{where}: `{key}` is given twice in section `{section}` (as {out[key][0]} and as "
                              f"{spelled}); keep one.")
        out[key] = (spelled, value)

    for raw, value in values.items():
        key = str(raw).replace("-", "_")
        if cls is TrainConfig and key in SECTION_TYPES:
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: `{section}.{key}` must be a mapping of option: value (the {key} options "
                                  f"of `dflash train`), not {value!r}.")
            for raw_inner, inner in value.items():
                name = str(raw_inner).replace("-", "_")
                spelled = f"{section}.{key}.{raw_inner}"
                owner = OWNER.get(name)
                if owner is None:
                    mine = sorted(f.name for f in dataclasses.fields(SECTION_TYPES[key]))
                    raise ConfigError(f"{where}: unknown option `{raw_inner}` in section `{section}.{key}`; valid "
                                      f"options are: {', '.join(mine)}.")
                if owner != key:
                    raise ConfigError(f"{where}: {spelled}: `{name}` belongs in {section}.{owner}, not in "
                                      f"{section}.{key}; move it there (or write it flat, as {section}.{name}).")
                put(name, inner, spelled)
            continue
        if key not in options:
            hint = f" (or the sections {', '.join(SECTION_TYPES)})" if cls is TrainConfig else ""
            raise ConfigError(
                f"{where}: unknown option `{raw}` in section `{section}`; "
                f"valid options are: {', '.join(sorted(options))}{hint}."
            )
        put(key, value, f"{section}.{raw}")
    return out


# Options that run code from elsewhere: taken from the command line or a config file named with --config,
# never from a ./params.yaml picked up implicitly (a checkout's file should not turn them on unseen).
EXPLICIT_ONLY = ("trust_remote_code",)


def build_config(cls: type, config_path: str | os.PathLike | None, overrides: dict[str, Any],
                 explicit: bool = True):
    """Dataclass defaults, then params.yaml's section for `cls`, then `overrides` (flags given).

    `explicit`: the config file was named (--config), not found as ./params.yaml; an implicit one may not
    turn on an EXPLICIT_ONLY option.  trust_remote_code, when on, is announced on stderr."""
    section = SECTIONS[cls]
    params = load_params(config_path)
    yaml_section = params.get(section) or {}
    if not isinstance(yaml_section, dict):
        raise ConfigError(f"{config_path}: section `{section}` must be a mapping of option: value.")
    options = options_of(cls)
    values: dict[str, Any] = {}
    origin = f"{config_path} [{section}]"
    for k, (spelled, value) in flat_section(cls, yaml_section, str(config_path)).items():
        values[k] = coerce(k, options[k].type, value, origin)
        if k in EXPLICIT_ONLY and values[k] and not explicit and overrides.get(k) is None:
            flag = "--" + k.replace("_", "-")
            raise ConfigError(
                f"{config_path}: `{spelled.split('.')[-1]}: true` in section `{section}` was read from a params.yaml "
                f"found in the current directory, not named with --config; {k} runs the target's own Python code, so "
                f"it is taken only from the command line ({flag}) or from a file passed with --config {config_path}. "
                "Pass one of those, or remove the key."
            )
    for key, value in overrides.items():
        if value is None:
            continue
        k = key.replace("-", "_")
        if k not in options:
            raise ConfigError(f"unknown option --{key.replace('_', '-')} for `{section}`.")
        values[k] = coerce(k, options[k].type, value, "command line")
    if values.get("trust_remote_code"):
        origin = "the command line" if overrides.get("trust_remote_code") else str(config_path)
        print(f"dflash: trust_remote_code is on (from {origin}): the target's own Python code will be run.",
              file=sys.stderr, flush=True)
    return cls(**values)


def to_dict(cfg) -> dict[str, Any]:
    """JSON-friendly view (tuples become lists) for manifests and run records; a TrainConfig is nested by
    section, as params.yaml's train section may be written."""
    def plain(d: dict) -> dict:
        return {k: plain(v) if isinstance(v, dict) else list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    return plain(dataclasses.asdict(cfg))


def flat_options(record: dict) -> dict[str, Any]:
    """A train record (the `train` part of RUN/config.json or a checkpoint's train_config.json, or a
    params.yaml train section) as {option: value}, whether it is nested by section or flat (runs made
    before the sections)."""
    out: dict[str, Any] = {}
    for k, v in record.items():
        if k in SECTION_TYPES and isinstance(v, dict):
            out.update(v)
        else:
            out[k] = v
    return out


__all__ = ["EXPLICIT_ONLY", "SECTIONS", "Option", "build_config", "default_config_path", "flat_options",
           "flat_section", "load_params", "options_of", "to_dict"]
