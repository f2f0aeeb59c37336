"""DFlash as the stages see it: the interface's defaults (dflash.drafter.family), named."""

from __future__ import annotations

from dflash.drafter.family import DrafterFamily


class DFlashFamily(DrafterFamily):
    """z-lab's DFlash: lm_head's argmax at every block position, trained with the decayed cross-entropy."""

    name = "dflash"
    architectures = ("DFlashDraftModel",)


FAMILY = DFlashFamily()

__all__ = ["FAMILY", "DFlashFamily"]
