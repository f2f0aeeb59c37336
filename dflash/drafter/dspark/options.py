"""DSpark's section of `dflash train`'s options (`train.dspark` in params.yaml, flat on the command line).

The config loader (dflash.config.train) reads it through the family (`FAMILY.options()`); a run reads
its values as `cfg.dspark` (`FAMILY.section(cfg)`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dflash.fields import Options, opt

TvSource = Literal["final_hidden", "topk"]


@dataclass
class DSparkOptions(Options):
    """`--arch dspark`: a Markov head and a confidence head, and their loss terms (docs/DESIGN.md §12)."""

    markov_rank: int = opt(256, "--arch dspark: rank of the Markov head's previous-token logit bias.")
    enable_confidence_head: bool = opt(True, "--arch dspark: train the confidence head (P(accept) per position).")
    confidence_head_with_markov: bool = opt(True, "--arch dspark: the confidence head also reads the Markov "
                                            "embedding of the previous token.")
    dspark_ce_weight: float = opt(0.1, "--arch dspark: weight of the cross-entropy term (DeepSpec's 0.1).")
    dspark_tv_weight: float = opt(0.9, "--arch dspark: weight of the distance to the target's distribution, "
                                  "sum |q - p| = 2 TV, as DeepSpec computes it (0.9).")
    dspark_confidence_weight: float = opt(1.0, "--arch dspark: weight of the confidence head's BCE against "
                                          "1 - TV, the acceptance probability.")
    tv_source: TvSource = opt("final_hidden", "--arch dspark: the target distribution p: final_hidden = the full "
                              "distribution recomputed from the store's final hidden state (precompute --final-hidden); "
                              "topk = the stored top-k, renormalised.")


__all__ = ["DSparkOptions", "TvSource"]
