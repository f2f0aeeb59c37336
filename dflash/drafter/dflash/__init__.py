"""DFlash (docs/DESIGN.md §2), the family the others build on.

    model.py    DFlashDrafter and its building blocks (layers, RoPE, the inference cache)
    family.py   FAMILY: what the stages ask of it (dflash.drafter.family's defaults)

The model's names are also importable from here; they load on first use, so that the config loader,
which reads FAMILY through the registry, never imports torch.
"""

from dflash.drafter.dflash.family import FAMILY
from dflash.drafter.family import lazy_attributes

__getattr__ = lazy_attributes("dflash.drafter.dflash.model")


__all__ = ["FAMILY"]
