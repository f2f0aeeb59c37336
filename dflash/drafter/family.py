"""What the stages ask of a drafter family: `DrafterFamily`, and the values that cross it.

A family (dflash, dflash2, dspark, ...) is one package under dflash/drafter/:

    model.py    its config (a DrafterConfig) and its drafter (a DFlashDrafter)
    loss.py     its own loss terms and teacher-forced proposals, where it has any
    options.py  its section of `dflash train`'s options, where it has one
    family.py   FAMILY: this interface, filled in

Training, preflight, export and evaluation ask the family (dflash.drafter.registry finds it by --arch, by
a config or by an export's `architectures`); none of them names one.  The store is never asked: the
caller asks the family what it needs (`needs`) and hands the store plain values.  At module level this
file and every family.py import no torch: the config loader reads --arch's choices and the families'
option sections through the registry, and `dflash --help` stays instant.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from dflash.drafter.config import DrafterConfig
    from dflash.drafter.labels import LossOutput


@dataclass(frozen=True)
class StoreNeeds:
    """What a run of a family reads beyond the context features, token ids and labels."""

    final_hidden: bool = False  # the target's last hidden state at each label's source position (--final-hidden)
    topk: bool = False  # the stored top-k target log-probs
    final_norm: bool = False  # the target's final norm weight (read from the target, not the store)


@dataclass
class LossInputs:
    """One micro-batch as a family's loss sees it, on the training device."""

    drafter: Any  # the drafter itself (not its DDP or compile wrapper)
    hidden: torch.Tensor  # [R, Q, H] the drafter's output, after its final norm
    lm_head: torch.Tensor  # [V, H] the target's, frozen
    labels: torch.Tensor  # [R, Q] (IGNORE where nothing is predicted)
    loss_weight: torch.Tensor  # [R, Q] the loader's decay weights
    block_input_ids: torch.Tensor  # [R, Q] the anchor, then mask tokens, per block
    label_index: torch.Tensor | None  # the flat labelled positions, made by the loader (saves a host sync)
    block_size: int
    denom: float | torch.Tensor  # what the step's loss sum is divided by (dflash.train.loss)
    chunk: int  # lm_head rows at a time
    options: Any  # the family's section of the run's options; None for a family without one
    # dflash.train.loss.block_loss under the run's objective (decay or D-PACE weights, KD), keeping each
    # labelled row's K best candidates (K = the argument, 0 = none): the decayed cross-entropy of DFlash
    block_loss: Callable[[int], LossOutput]
    topk_ids: torch.Tensor | None = None  # [R, Q, K] when the run reads the stored top-k
    topk_logprobs: torch.Tensor | None = None
    final_hidden: torch.Tensor | None = None  # [R, Q, H] when the family needs it (StoreNeeds.final_hidden)
    final_norm: torch.Tensor | None = None  # [H] when the family needs it (StoreNeeds.final_norm)


class DrafterFamily:
    """A drafter family as the stages see it.  Beyond its classes, the defaults are what DFlash does (the
    decayed cross-entropy, lm_head's argmax as proposals): a family overrides what differs."""

    name: str = ""  # its --arch
    summary: str = ""  # what --arch's help says of it (empty: its name alone)
    architectures: tuple[str, ...] = ()  # the config.json `architectures` it is read from; the first is written
    knobs: tuple[str, ...] = ()  # its own config fields, set from its option section; a resume must keep them
    # Modules trained outside the drafter's forward (heads, selectors): FSDP2 would not unshard them.
    heads_outside_forward: bool = False

    def options(self) -> type | None:
        """Its section of `dflash train`'s options (named after the family), or None; the config loader
        calls this, and a run reads the values as `getattr(cfg, family.name)` (`section`)."""
        return None

    def section(self, cfg) -> Any:
        """The values of its option section in the run's config `cfg` (None for a family without one)."""
        return getattr(cfg, self.name, None)

    def config_class(self) -> type[DrafterConfig]:
        """Its config: DrafterConfig or a subclass (its own fields, `from_base`, its config.json round trip)."""
        raise NotImplementedError

    def drafter_class(self) -> type:
        """Its drafter: DFlashDrafter or a subclass, built as cls(config, flex_kernel_options, context_scale)."""
        raise NotImplementedError

    def with_knobs(self, cfg: DrafterConfig, **knobs) -> DrafterConfig:
        """`cfg` (a DFlash config) as this family's, with these own fields (None = the default)."""
        return cfg if not self.knobs else self.config_class().from_base(cfg, **knobs)

    def config_for(self, cfg: DrafterConfig, options) -> DrafterConfig:
        """with_knobs, the knobs read off the run's option section of the family."""
        return self.with_knobs(cfg, **{k: getattr(options, k) for k in self.knobs})

    def export_keys(self, cfg: DrafterConfig) -> list[str]:
        """The tensor names of its export (and of its checkpoints, less --context-scale's buffer)."""
        return self.drafter_class().export_keys(cfg)

    def needs(self, options) -> StoreNeeds:
        """What a run with these option values reads beyond features and labels."""
        return StoreNeeds()

    def check(self, cfg, store) -> None:
        """A ConfigError or StoreError when the run's options `cfg` cannot train on `store` (its manifest
        read); preflight calls it before anything runs."""

    def loss(self, x: LossInputs) -> LossOutput:
        """The micro-batch's loss and the statistics the step logs."""
        return x.block_loss(0)

    def loss_sum(self, stats, cfg) -> float:
        """The step's weighted loss sum from its summed statistics (dflash.train.step.StepStats)."""
        return stats.ce_sum + cfg.objective.kd_weight * stats.kd_sum

    def metrics(self, stats, weight_sum: float) -> dict:
        """Its own entries of a step's metrics record, beside ce and kd."""
        return {}

    def predictions(self, drafter, hidden, lm_head, labels, block_input_ids, block_size: int) -> torch.Tensor:
        """[R, Q] the proposals where there is a label (-1 elsewhere), as the family serves them: earlier
        positions teacher-forced where it conditions on them, so up to a block's first miss they equal the
        served walk's, and the acceptance length they give is the served one."""
        from dflash.drafter.labels import greedy_predictions

        return greedy_predictions(hidden, lm_head, labels)

    def draft(self, drafter, hidden, lm_head, anchor, confidence_threshold: float | None) -> tuple[torch.Tensor, int]:
        """The served proposals [B-1] of one decoding block (hidden [1, B-1, H] after the final norm, after
        the anchor token [1]) and how many of them the target verifies."""
        return drafter.propose(hidden, lm_head, anchor.view(1))[0], drafter.config.block_size - 1

    def export_check(self, exported, reference, batch, lm_head) -> tuple[float, bool]:
        """Beyond the logits of the block: (the largest difference of the family's other outputs, whether
        its served proposals agree) of a reloaded export and the model it came from, on `batch`."""
        return 0.0, True


def lazy_attributes(module: str) -> Callable[[str], Any]:
    """A family package's module-level `__getattr__`: its model's names load from `module` on first use, so
    that importing the package (as the config loader does, through the registry) never imports torch."""
    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        import importlib

        return getattr(importlib.import_module(module), name)

    return __getattr__


__all__ = ["DrafterFamily", "LossInputs", "StoreNeeds", "lazy_attributes"]
