"""The drafter families dflash trains, by --arch name, and the lookups the stages make.

Adding a family is its package (dflash/drafter/<name>/, see dflash.drafter.family) and one line here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflash.drafter.dflash import FAMILY as DFLASH
from dflash.drafter.dflash2 import FAMILY as DFLASH2
from dflash.drafter.dspark import FAMILY as DSPARK
from dflash.drafter.family import DrafterFamily

if TYPE_CHECKING:
    from dflash.drafter.config import DrafterConfig

FAMILIES: dict[str, DrafterFamily] = {f.name: f for f in (DFLASH, DFLASH2, DSPARK)}
ARCHS = tuple(FAMILIES)


def family(arch: str) -> DrafterFamily:
    """The family named `arch` (an --arch value); ValueError for any other name."""
    if arch not in FAMILIES:
        raise ValueError(f"arch {arch!r} is not one of {', '.join(ARCHS)}")
    return FAMILIES[arch]


def family_of(cfg: DrafterConfig) -> DrafterFamily:
    """The family of a drafter config: the one whose config class is the most derived `cfg` is an instance of."""
    for f in reversed(FAMILIES.values()):
        if isinstance(cfg, f.config_class()):
            return f
    raise TypeError(f"{type(cfg).__name__} is not the config of a dflash drafter")


def family_of_hf(d: dict) -> DrafterFamily | None:
    """The family of an export's or checkpoint's config.json, by `architectures` (what the engines dispatch
    on); DFlash when it names none; None when it names no family of dflash."""
    names = d.get("architectures") or ["DFlashDraftModel"]
    for f in reversed(FAMILIES.values()):  # a family's own name before the DFlash one it builds on
        if any(a in names for a in f.architectures):
            return f
    return None


def config_from_hf_dict(d: dict) -> DrafterConfig:
    """The config of an export's config.json, of its family's class (DFlash when the name is unknown)."""
    return (family_of_hf(d) or DFLASH).config_class().from_hf_dict(d)


def build_drafter(cfg: DrafterConfig, flex_kernel_options: dict | None = None, context_scale: bool = False):
    """The drafter of `cfg`'s family, freshly initialised; `context_scale`: with the context_scale buffer of
    `--context-scale rms` (all ones until it is set)."""
    return family_of(cfg).drafter_class()(cfg, flex_kernel_options, context_scale)


def with_arch(cfg: DrafterConfig, arch: str, **knobs) -> DrafterConfig:
    """`cfg` (a DFlash config) as the family `arch` asks for; knobs are the family's own config fields."""
    return family(arch).with_knobs(cfg, **knobs)


def arch_of(cfg: DrafterConfig) -> str:
    return family_of(cfg).name


def export_keys(cfg: DrafterConfig) -> list[str]:
    """The exported tensor names of a drafter of this config."""
    return family_of(cfg).export_keys(cfg)


__all__ = ["ARCHS", "FAMILIES", "arch_of", "build_drafter", "config_from_hf_dict", "export_keys", "family", "family_of",
           "family_of_hf", "with_arch"]
