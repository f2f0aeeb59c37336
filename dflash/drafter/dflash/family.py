"""DFlash as the stages see it: its classes, and the interface's defaults (dflash.drafter.family)."""

from __future__ import annotations

from dflash.drafter.family import DrafterFamily


class DFlashFamily(DrafterFamily):
    """z-lab's DFlash: lm_head's argmax at every block position, trained with the decayed cross-entropy."""

    name = "dflash"
    architectures = ("DFlashDraftModel",)

    def config_class(self) -> type:
        from dflash.drafter.config import DrafterConfig

        return DrafterConfig

    def drafter_class(self) -> type:
        from dflash.drafter.dflash.model import DFlashDrafter

        return DFlashDrafter


FAMILY = DFlashFamily()

__all__ = ["FAMILY", "DFlashFamily"]
