"""DFlash2 (docs/DESIGN.md §11): DFlash plus grouped dynamic block convolutions and a candidate selector.

    model.py    DFlash2Config, the convolution, the selector and DFlash2Drafter
    loss.py     the selector's K-way cross-entropy term and its teacher-forced proposals
    options.py  its section of `dflash train`'s options (`train.dflash2`)
    family.py   FAMILY: what the stages ask of it

The model's names are also importable from here; they load on first use, so that the config loader,
which reads FAMILY through the registry, never imports torch.
"""

from dflash.drafter.dflash2.family import FAMILY
from dflash.drafter.family import lazy_attributes

__getattr__ = lazy_attributes("dflash.drafter.dflash2.model")


__all__ = ["FAMILY"]
