"""Every knob of every stage, as dataclasses.

Values come from three layers, later ones winning: the dataclass default, the stage's section of
`params.yaml` (`--config`, default `./params.yaml` when present), then flags given on the command line.
Unknown keys in params.yaml are an error (a typo there would otherwise silently do nothing).

    stages.py   GenerateConfig, PrecomputeConfig, EvalConfig, ExportConfig: one flat group of options each
    train.py    TrainConfig: `dflash train`'s options in sections (job, drafter, optim, data, ...)
    load.py     build_config: defaults < params.yaml (nested or flat) < flags; to_dict, flat_options
    docs.py     docs/OPTIONS.md (`python -m dflash.config > docs/OPTIONS.md`)

A field and its help (`opt`), its choices and their coercion are dflash.fields' (the drafter families'
option sections are written with them too, dflash.drafter.<family>.options).
"""

from __future__ import annotations

from dataclasses import Field

from dflash.config.docs import options_markdown
from dflash.config.load import (
    EXPLICIT_ONLY,
    SECTIONS,
    Option,
    build_config,
    default_config_path,
    flat_options,
    flat_section,
    load_params,
    options_of,
    to_dict,
)
from dflash.config.stages import EvalConfig, ExportConfig, GenerateConfig, PrecomputeConfig
from dflash.config.train import OWNER, SECTION_TYPES, TrainConfig
from dflash.fields import AutoOnOff, Options, check_choice, choices_of, opt, show_default

# each command's options by flat name (for TrainConfig across its sections): the field, with its help
FIELDS: dict[type, dict[str, Field]] = {cls: {n: o.field for n, o in options_of(cls).items()} for cls in SECTIONS}

__all__ = [
    "EXPLICIT_ONLY",
    "FIELDS",
    "OWNER",
    "SECTIONS",
    "SECTION_TYPES",
    "AutoOnOff",
    "EvalConfig",
    "ExportConfig",
    "GenerateConfig",
    "Option",
    "Options",
    "PrecomputeConfig",
    "TrainConfig",
    "build_config",
    "check_choice",
    "choices_of",
    "default_config_path",
    "flat_options",
    "flat_section",
    "load_params",
    "opt",
    "options_markdown",
    "options_of",
    "show_default",
    "to_dict",
]
