"""The drafters dflash trains, and the registry of their variants.

    config.py     DrafterConfig and its round trip through the export's config.json
    dflash.py     the DFlash drafter (z-lab's DFlashDraftModel) and its building blocks
    dflash2.py    DFlash2: DFlash plus dynamic convolutions and a candidate selector (docs/DESIGN.md §11)
    dspark.py     DSpark: DFlash plus a Markov head and a confidence head (docs/DESIGN.md §12)
    masks.py      a packed row's block-sparse attention masks, as pure functions of its ranges
    attention.py  attention under those masks, and the one choice of how it is computed

A variant is its drafter class: `arch` (its --arch name), `config_cls`, `knobs` (its own config fields),
`selects_candidates`, `dspark_heads`, `propose` and `export_keys` say what the callers need to know of it.
"""

from __future__ import annotations

from dflash.drafter.config import DrafterConfig
from dflash.drafter.dflash import DFlashDrafter
from dflash.drafter.dflash2 import ARCHITECTURE as DFLASH2_ARCHITECTURE
from dflash.drafter.dflash2 import DFlash2Config, DFlash2Drafter
from dflash.drafter.dspark import ARCHITECTURE as DSPARK_ARCHITECTURE
from dflash.drafter.dspark import DSparkConfig, DSparkDrafter

VARIANTS: dict[str, type[DFlashDrafter]] = {v.arch: v for v in (DFlashDrafter, DFlash2Drafter, DSparkDrafter)}
ARCHS = tuple(VARIANTS)


def variant_of(cfg: DrafterConfig) -> type[DFlashDrafter]:
    """The drafter class of a config (the most derived config class it is an instance of)."""
    for v in reversed(VARIANTS.values()):
        if isinstance(cfg, v.config_cls):
            return v
    raise TypeError(f"{type(cfg).__name__} is not the config of a dflash drafter")


def arch_of(cfg: DrafterConfig) -> str:
    return variant_of(cfg).arch


def build_drafter(cfg: DrafterConfig, flex_kernel_options: dict | None = None,
                  context_scale: bool = False) -> DFlashDrafter:
    """The drafter of `cfg`'s variant (DFlashDrafter, DFlash2Drafter or DSparkDrafter), freshly initialised;
    `context_scale`: with the context_scale buffer of `--context-scale rms` (all ones until it is set)."""
    return variant_of(cfg)(cfg, flex_kernel_options, context_scale)


def config_from_hf_dict(d: dict) -> DrafterConfig:
    """DrafterConfig, DFlash2Config or DSparkConfig, by `architectures` (what the engines dispatch on too;
    SpecForge names a DSpark drafter DSparkDraftModel)."""
    names = d.get("architectures") or ()
    if DFLASH2_ARCHITECTURE in names:
        return DFlash2Config.from_hf_dict(d)
    if DSPARK_ARCHITECTURE in names or "DSparkDraftModel" in names:
        return DSparkConfig.from_hf_dict(d)
    return DrafterConfig.from_hf_dict(d)


def with_arch(cfg: DrafterConfig, arch: str, **knobs) -> DrafterConfig:
    """`cfg` (a DFlash config) as the drafter `arch` asks for; knobs are the variant's own config fields."""
    if arch not in VARIANTS:
        raise ValueError(f"arch {arch!r} is not one of {', '.join(ARCHS)}")
    if arch == "dflash":
        return cfg
    return VARIANTS[arch].config_cls.from_base(cfg, **knobs)


def config_for(cfg: DrafterConfig, arch: str, options) -> DrafterConfig:
    """with_arch with the variant's knobs read off `options` (the section of a run's config named after the
    variant, which names them as its fields)."""
    knobs = VARIANTS[arch].knobs if arch in VARIANTS else ()
    return with_arch(cfg, arch, **{k: getattr(options, k) for k in knobs})


def export_keys(cfg: DrafterConfig) -> list[str]:
    """The exported tensor names of either drafter."""
    return variant_of(cfg).export_keys(cfg)


__all__ = ["ARCHS", "VARIANTS", "DFlash2Config", "DFlash2Drafter", "DFlashDrafter", "DSparkConfig", "DSparkDrafter",
           "DrafterConfig", "arch_of",
           "build_drafter", "config_for", "config_from_hf_dict", "export_keys", "variant_of", "with_arch"]
