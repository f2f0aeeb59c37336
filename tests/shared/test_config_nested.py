"""`dflash train`'s options in sections (dflash/config/train.py): params.yaml nested or flat, a key under the
wrong section named with the right one, Literal choices checked once, and every field a flat flag."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import click
import pytest
import yaml

from dflash import cli
from dflash.config import (
    OWNER,
    SECTION_TYPES,
    SECTIONS,
    TrainConfig,
    build_config,
    choices_of,
    flat_options,
    options_of,
    show_default,
    to_dict,
)
from dflash.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
NESTED = {"job": {"gpus": "cpu:2", "seed": 3}, "drafter": {"block_size": 8, "arch": "dflash2"},
          "optim": {"lr": 0.002, "betas": [0.8, 0.9]}, "dflash2": {"selector_rank": 32},
          "stream": {"follow_poll": 2.5}}


def _write(tmp_path, train: dict) -> Path:
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump({"train": train}))
    return p


def test_nested_params_are_read_into_their_sections(tmp_path):
    cfg = build_config(TrainConfig, _write(tmp_path, NESTED), {})
    assert (cfg.job.gpus, cfg.job.seed, cfg.drafter.block_size, cfg.drafter.arch) == ("cpu:2", 3, 8, "dflash2")
    assert (cfg.optim.lr, cfg.optim.betas, cfg.dflash2.selector_rank, cfg.stream.follow_poll) == \
        (0.002, (0.8, 0.9), 32, 2.5)
    assert cfg.objective == SECTION_TYPES["objective"]()  # untouched sections keep their defaults


def test_flat_params_give_the_same_config_as_nested(tmp_path):
    flat = {k: v for section in NESTED.values() for k, v in section.items()}
    (tmp_path / "flat").mkdir()
    (tmp_path / "mix").mkdir()
    nested = build_config(TrainConfig, _write(tmp_path, NESTED), {})
    assert build_config(TrainConfig, _write(tmp_path / "flat", flat), {}) == nested
    mixed = {"lr": 0.002, "betas": [0.8, 0.9], **{k: v for k, v in NESTED.items() if k != "optim"}}
    assert build_config(TrainConfig, _write(tmp_path / "mix", mixed), {}) == nested
    assert nested != TrainConfig()


def test_the_repositorys_params_yaml_is_nested_and_reads_as_its_flat_form(tmp_path):
    params = yaml.safe_load((ROOT / "params.yaml").read_text())["train"]
    assert set(params) <= set(SECTION_TYPES), "params.yaml's train section is written by section"
    nested = build_config(TrainConfig, ROOT / "params.yaml", {})
    assert build_config(TrainConfig, _write(tmp_path, flat_options(params)), {}) == nested
    assert nested.optim.lr == params["optim"]["lr"]


def test_flags_win_over_nested_params(tmp_path):
    cfg = build_config(TrainConfig, _write(tmp_path, NESTED), {"lr": "0.01", "block_size": 4, "arch": None})
    assert (cfg.optim.lr, cfg.drafter.block_size, cfg.drafter.arch) == (0.01, 4, "dflash2")


@pytest.mark.parametrize("section,key,owner", [("drafter", "lr", "optim"), ("optim", "block_size", "drafter"),
                                               ("job", "follow", "stream")])
def test_a_key_under_the_wrong_section_names_the_right_one(tmp_path, section, key, owner):
    p = _write(tmp_path, {section: {key: 1}})
    with pytest.raises(ConfigError) as e:
        build_config(TrainConfig, p, {})
    msg = str(e.value)
    assert f"train.{section}.{key}" in msg and f"belongs in train.{owner}" in msg, msg
    assert "\n" not in msg


def test_unknown_keys_stay_errors_in_a_section_and_flat(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown option `lrr` in section `train.optim`; valid options are: .*lr"):
        build_config(TrainConfig, _write(tmp_path, {"optim": {"lrr": 1}}), {})
    with pytest.raises(ConfigError, match="unknown option `lrr` in section `train`"):
        build_config(TrainConfig, _write(tmp_path, {"lrr": 1}), {})
    with pytest.raises(ConfigError, match="`train.optim` must be a mapping"):
        build_config(TrainConfig, _write(tmp_path, {"optim": 0.1}), {})
    with pytest.raises(ConfigError, match="`lr` is given twice"):
        build_config(TrainConfig, _write(tmp_path, {"lr": 0.1, "optim": {"lr": 0.2}}), {})


def test_a_literal_choice_is_refused_naming_the_field_and_its_choices(tmp_path):
    with pytest.raises(ConfigError, match=r"`parallel` = 'zero' is not one of ddp, fsdp"):
        build_config(TrainConfig, _write(tmp_path, {"systems": {"parallel": "zero"}}), {})
    with pytest.raises(ConfigError, match=r"command line: `arch` = 'eagle' is not one of dflash, dflash2, dspark"):
        build_config(TrainConfig, None, {"arch": "eagle"})
    # built in Python, the same check (there is no other)
    with pytest.raises(ConfigError, match=r"`loss_kernel` = 'cuda' is not one of triton, compiled"):
        TrainConfig(loss_kernel="cuda")
    with pytest.raises(ConfigError, match=r"`tv_source` = 'x' is not one of final_hidden, topk"):
        dataclasses.replace(TrainConfig(), dspark=SECTION_TYPES["dspark"](tv_source="x"))


def test_unquoted_yaml_on_and_off_read_as_the_choices_they_spell(tmp_path):
    p = tmp_path / "params.yaml"
    p.write_text("train:\n  systems:\n    compile: off\n")  # YAML 1.1: a boolean false
    assert build_config(TrainConfig, p, {}).systems.compile == "off"
    p.write_text("train:\n  systems:\n    compile: on\n")
    assert build_config(TrainConfig, p, {}).systems.compile == "on"
    # a boolean stays refused where the choices do not spell on/off
    with pytest.raises(ConfigError, match=r"`parallel` = True is not one of ddp, fsdp"):
        build_config(TrainConfig, _write(tmp_path, {"systems": {"parallel": True}}), {})


def test_the_arch_choices_are_the_drafter_registry():
    from dflash.drafter import ARCHS, FAMILIES

    arch = options_of(TrainConfig)["arch"]
    assert choices_of(arch.type) == ARCHS
    for name, family in FAMILIES.items():  # a family's knobs are the fields of the section named after it
        if family.knobs:
            assert set(family.knobs) <= {f.name for f in dataclasses.fields(SECTION_TYPES[name])}, name


def test_the_command_line_and_its_config_load_without_torch():
    # the config reads --arch's choices and the families' sections from the drafter registry: that must not
    # pull in a model (the CLI's help would wait for torch)
    code = ("import sys, dflash.cli, dflash.drafter; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_rules_of_a_section_and_across_sections():
    TrainConfig(store="s", target="t", out="o").check()
    with pytest.raises(ConfigError, match="needs --store"):
        TrainConfig().check()
    ok = {"store": "s", "target": "t", "out": "o"}
    for bad, message in [({"block_size": 1}, "--block-size must be at least 2"),
                         ({"resume": True, "overwrite": True}, "contradict"),
                         ({"block_budget": 4, "block_size": 8}, "block_budget must hold at least one block"),
                         ({"follow": True}, "--follow needs --steps")]:
        with pytest.raises(ConfigError, match=message):
            TrainConfig(**ok, **bad).check()


@pytest.mark.parametrize("cls", list(SECTIONS), ids=lambda c: c.__name__)
def test_every_field_of_every_section_is_a_flag_with_help_and_round_trips(cls):
    command = cli.main.commands[SECTIONS[cls]]
    opts = {p.name: p for p in command.params if isinstance(p, click.Option)}
    args = [p.name for p in command.params if isinstance(p, click.Argument)]
    groups = SECTION_TYPES.values() if cls is TrainConfig else [cls]
    for group in groups:
        hints = typing.get_type_hints(group)
        for f in dataclasses.fields(group):
            if f.name in args:
                continue
            o = opts.get(f.name)
            assert o is not None and o.opts == ["--" + f.name.replace("_", "-")], f.name
            assert len(f.metadata["help"]) > 10 and o.help.startswith(f.metadata["help"]), f.name
            # the flag round-trips: a value given as text comes back as the field's value
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            choices = choices_of(hints[f.name])
            value = (choices[-1] if choices else not default if hints[f.name] is bool
                     else "7" if hints[f.name] in (int, float, int | None, float | None) else None)
            if value is None:
                value = show_default(f) if show_default(f) != "-" else ("3,4" if "list" in str(hints[f.name]) else "x")
            argv = ([f"--{'' if value else 'no-'}{f.name.replace('_', '-')}"] if hints[f.name] is bool
                    else ["--" + f.name.replace("_", "-"), str(value)])
            ctx = command.make_context(command.name, (["src", "dst"] if args else []) + argv)
            flags = {k: v for k, v in ctx.params.items() if k not in args and k != "config"}
            built = build_config(cls, None, {**flags, **dict(zip(args, ["src", "dst"]))})
            got = getattr(getattr(built, options_of(cls)[f.name].section), f.name) if cls is TrainConfig \
                else getattr(built, f.name)
            want = build_config(cls, None, {f.name: value})
            want = getattr(want, f.name)
            assert got == want and flags[f.name] is not None, (f.name, got, want)


def test_to_dict_is_nested_and_flat_options_reads_old_flat_records(tmp_path):
    cfg = TrainConfig(lr=0.001, block_size=8)
    d = to_dict(cfg)
    assert set(d) == set(SECTION_TYPES) and d["optim"]["lr"] == 0.001 and d["optim"]["betas"] == [0.9, 0.95]
    flat = flat_options(d)
    assert set(flat) == set(OWNER) and build_config(TrainConfig, _write(tmp_path, flat), {}) == cfg
    assert build_config(TrainConfig, _write(tmp_path, d), {}) == cfg  # a record is a params.yaml train section
    assert flat_options({"target": "/t", "lr": 1.0}) == {"target": "/t", "lr": 1.0}  # a run made before sections


def test_flat_attributes_read_but_never_write():
    cfg = TrainConfig(lr=0.001)
    assert cfg.lr == cfg.optim.lr == 0.001
    with pytest.raises(AttributeError, match="set cfg.optim.lr"):
        cfg.lr = 0.1
    with pytest.raises(AttributeError):
        _ = cfg.no_such_option
    with pytest.raises(TypeError, match="unexpected option 'lrr'"):
        TrainConfig(lrr=1)
