"""Each option's help is written once (dflash/config/) and used by click, docs/OPTIONS.md and params.yaml."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click
import pytest
import yaml

from dflash import cli
from dflash.config import FIELDS, SECTIONS, ExportConfig, choices_of, flat_section, options_markdown, options_of

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = {"precompute": "precompute", "train": "train", "eval": "eval", "export": "export"}


@pytest.mark.parametrize("cls", list(SECTIONS), ids=lambda c: c.__name__)
def test_every_field_is_a_flag_with_the_fields_own_help(cls):
    command = cli.main.commands[SECTIONS[cls]]
    opts = {p.name: p for p in command.params if isinstance(p, click.Option) and p.name != "config"}
    args = {p.name for p in command.params if isinstance(p, click.Argument)}
    fields = FIELDS[cls]
    assert set(opts) | args == set(fields), set(opts) ^ set(fields)
    for name, o in opts.items():
        assert o.help.startswith(fields[name].metadata["help"]), name
        choices = choices_of(options_of(cls)[name].type)
        if choices:
            assert list(o.type.choices) == list(choices), name
    # no flag given: every value is None, so params.yaml's values (or the dataclass defaults) apply
    ctx = command.make_context(command.name, ["src", "dst"] if args else [])
    given = {k: v for k, v in ctx.params.items() if k not in args and k != "config" and v is not None}
    assert not given, f"click defaults would hide params.yaml's values: {given}"


def test_every_field_has_help():
    for cls, fields in FIELDS.items():
        for name, f in fields.items():
            assert len(f.metadata.get("help", "")) > 10, f"{cls.__name__}.{name} has no help"


def test_options_doc_is_generated_from_the_fields():
    assert (ROOT / "docs" / "OPTIONS.md").read_text().strip() == options_markdown().strip(), \
        "docs/OPTIONS.md is stale: python -m dflash.config > docs/OPTIONS.md"


def test_params_yaml_sets_only_documented_options():
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    by_section = {s: c for c, s in SECTIONS.items()}
    for section, values in params.items():
        assert section in by_section, section
        assert set(flat_section(by_section[section], values, "params.yaml")) <= set(FIELDS[by_section[section]])


def test_a_value_outside_the_choices_is_refused_from_params_yaml_too(tmp_path):
    from dflash.config import build_config
    from dflash.errors import ConfigError

    p = tmp_path / "params.yaml"
    p.write_text("export:\n  dtype: fp64\n")
    with pytest.raises(ConfigError, match="`dtype` = 'fp64' is not one of bf16, fp16, fp32"):
        build_config(ExportConfig, p, {})
    assert dataclasses.replace(build_config(ExportConfig, None, {"dtype": "fp16"})).dtype == "fp16"
