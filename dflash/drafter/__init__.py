"""The drafter families dflash trains, one package each, and what they share.

    registry.py   the families by --arch name, and the lookups the stages make (build_drafter, ...)
    family.py     DrafterFamily: what training, preflight, export and evaluation ask of a family
    dflash/       DFlash (z-lab's DFlashDraftModel), the backbone the others build on
    dflash2/      DFlash2: dynamic block convolutions and a candidate selector (docs/DESIGN.md §11)
    dspark/       DSpark: a Markov head and a confidence head (docs/DESIGN.md §12)
    config.py     DrafterConfig and its round trip through the export's config.json
    labels.py     a packed row's labels, acceptance statistics, and what a family's loss returns
    masks.py      a packed row's block-sparse attention masks, as pure functions of its ranges
    attention.py  attention under those masks, and the one choice of how it is computed

The model classes are importable from here too; they load on first use, so that importing the registry
(the config loader does, for --arch's choices and the families' option sections) never imports torch.
"""

from __future__ import annotations

from dflash.drafter.registry import (
    ARCHS,
    FAMILIES,
    arch_of,
    build_drafter,
    config_from_hf_dict,
    export_keys,
    family,
    family_of,
    family_of_hf,
    with_arch,
)


def __getattr__(name: str):
    if name == "DrafterConfig":
        from dflash.drafter.config import DrafterConfig

        return DrafterConfig
    if name == "DFlashDrafter":
        from dflash.drafter.dflash.model import DFlashDrafter

        return DFlashDrafter
    if name in ("DFlash2Config", "DFlash2Drafter"):
        import dflash.drafter.dflash2.model as dflash2

        return getattr(dflash2, name)
    if name in ("DSparkConfig", "DSparkDrafter"):
        import dflash.drafter.dspark.model as dspark

        return getattr(dspark, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ARCHS", "FAMILIES", "DFlash2Config", "DFlash2Drafter", "DFlashDrafter", "DSparkConfig", "DSparkDrafter",
           "DrafterConfig", "arch_of", "build_drafter", "config_from_hf_dict", "export_keys", "family", "family_of",
           "family_of_hf", "with_arch"]
