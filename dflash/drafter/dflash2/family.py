"""DFlash2 as the stages see it: DFlash plus a candidate selector trained beside the loss and served as
a greedy walk (docs/DESIGN.md §11)."""

from __future__ import annotations

from dflash.drafter.family import DrafterFamily, LossInputs


class DFlash2Family(DrafterFamily):
    name = "dflash2"
    summary = "grouped dynamic block convolutions and a top-K candidate selector; exported as DFlash2DraftModel"
    heads_outside_forward = True  # the selector's term is computed after the forward

    @property
    def architectures(self) -> tuple[str, ...]:
        from dflash.drafter.dflash2.model import ARCHITECTURE

        return (ARCHITECTURE,)

    @property
    def knobs(self) -> tuple[str, ...]:
        from dflash.drafter.dflash2.model import REQUIRED

        return REQUIRED

    def options(self) -> type:
        from dflash.drafter.dflash2.options import DFlash2Options

        return DFlash2Options

    def config_class(self) -> type:
        from dflash.drafter.dflash2.model import DFlash2Config

        return DFlash2Config

    def drafter_class(self) -> type:
        from dflash.drafter.dflash2.model import DFlash2Drafter

        return DFlash2Drafter

    def loss(self, x: LossInputs):
        """The decayed cross-entropy, its lm_head pass keeping the selector's candidates, plus the selector's
        K-way cross-entropy; the statistics measure the selector's proposals, as served."""
        from dflash.drafter.dflash2.loss import add_selector_term
        from dflash.drafter.labels import labelled

        out = x.block_loss(x.drafter.config.selector_top_k)
        sel = labelled(x.labels, x.label_index)
        return add_selector_term(out, x.drafter, x.hidden, x.labels, x.block_input_ids, sel, block_size=x.block_size,
                                 denom=x.denom, weight=x.options.selector_loss_weight)

    def predictions(self, drafter, hidden, lm_head, labels, block_input_ids, block_size: int):
        from dflash.drafter.dflash2.loss import selector_predictions

        return selector_predictions(drafter, hidden, lm_head, labels, block_input_ids, block_size)

    def export_check(self, exported, reference, batch, lm_head) -> tuple[float, bool]:
        """The served proposals of the same block must agree too."""
        import torch

        h, anchor = reference(*batch)[:, 1 : reference.config.block_size], torch.zeros(1, dtype=torch.long)
        return 0.0, bool((exported.propose(h, lm_head, anchor) == reference.propose(h, lm_head, anchor)).all())


FAMILY = DFlash2Family()

__all__ = ["FAMILY", "DFlash2Family"]
