"""DSpark (docs/DESIGN.md §12): DFlash plus a Markov head and a confidence head.

    model.py    DSparkConfig, the heads, DSparkDrafter and vLLM's verify-capacity rule
    loss.py     its objective (CE, the distance to the target's distribution, the confidence BCE)
    options.py  its section of `dflash train`'s options (`train.dspark`)
    family.py   FAMILY: what the stages ask of it, and the store it needs

The model's names are also importable from here; they load on first use, so that the config loader,
which reads FAMILY through the registry, never imports torch.
"""

from dflash.drafter.dspark.family import FAMILY
from dflash.drafter.family import lazy_attributes

__getattr__ = lazy_attributes("dflash.drafter.dspark.model")


__all__ = ["FAMILY"]
