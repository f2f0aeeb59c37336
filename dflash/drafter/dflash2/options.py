"""DFlash2's section of `dflash train`'s options (`train.dflash2` in params.yaml, flat on the command line).

The config loader (dflash.config.train) reads it through the family (`FAMILY.options()`); a run reads
its values as `cfg.dflash2` (`FAMILY.section(cfg)`).
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash.fields import Options, opt


@dataclass
class DFlash2Options(Options):
    """`--arch dflash2`: grouped dynamic block convolutions and a top-K candidate selector (docs/DESIGN.md §11)."""

    conv_kernel_size: int = opt(2, "--arch dflash2: taps of each block convolution.")
    conv_group_size: int = opt(16, "--arch dflash2: channels per dynamic coefficient (divides the hidden size).")
    selector_rank: int = opt(256, "--arch dflash2: rank of the candidate selector's transition.")
    selector_top_k: int = opt(16, "--arch dflash2: lm_head candidates the selector reranks per position.")
    selector_loss_weight: float = opt(1.0, "--arch dflash2: weight of the selector's K-way cross-entropy term.")


__all__ = ["DFlash2Options"]
