"""The resolved run: what preflight works out once for all the training processes of a run.

`dflash.train.preflight.preflight` builds it in the launcher; each training process receives it as an
argument (torch's elastic launcher pickles it to the processes it spawns).  Under an outside torchrun
every rank starts by itself, so rank 0 runs preflight and broadcasts the result over the process group
(`dflash.train.preflight.resolved_by_rank0`): the process group is the one channel every rank of a multi-node run is sure to
share (the run directory is rank 0's and need not be visible on other nodes), and a refusal reaches the
other ranks as the same error instead of leaving them waiting.

It holds no open store: the store may grow between preflight and an epoch, so each process opens what it
reads (dflash.train.epochs), and the object stays small and picklable.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dflash.config import TrainConfig, to_dict
from dflash.train.plan import LoaderSpec


@dataclass(frozen=True)
class ResolvedRun:
    cfg: TrainConfig  # with mask_token_id set to the resolved one
    drafter_config: object  # dflash.drafter.DrafterConfig (of the run's family)
    spec: LoaderSpec
    mask_token_id: int
    mask_token_source: str  # the token's text and the rule that chose it
    layer_types_source: str  # where the drafter's layer types came from
    feature_width: int  # values of a stored token's context features (hidden size x target layers)
    store_record: dict  # the store part of RUN/config.json
    # --drafter-init target: {"copies": {drafter name: (file, target name)}, "record": ...} (train/drafter_init.py)
    drafter_init: dict | None = None
    # --context-scale rms on a fresh run: {"scale": float32 [L*H], "record": ...} (train/context_scale.py);
    # None otherwise (a resumed run takes its checkpoint's buffer).
    context_scale: dict | None = None

    def embed_and_head(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's frozen embedding and lm_head on `device` (bf16 on GPU, fp32 on CPU)."""
        from dflash.target_model.files import load_embed_and_head

        embed, head = load_embed_and_head(self.cfg.job.target)
        dtype = torch.bfloat16 if device.type == "cuda" and self.cfg.systems.precision != "fp32" else torch.float32
        embed = embed.to(device, dtype)
        head = embed if head is embed else head.to(device, dtype)
        return embed.requires_grad_(False), head.requires_grad_(False)

    def final_norm(self, device: torch.device) -> torch.Tensor | None:
        """The target's frozen final norm weight, in the lm_head's dtype on `device`, for a drafter family
        that needs it (StoreNeeds.final_norm: to recompute the target's distribution); None otherwise."""
        from dflash.drafter import family

        fam = family(self.cfg.drafter.arch)
        if not fam.needs(fam.section(self.cfg)).final_norm:
            return None
        from dflash.target_model.files import load_final_norm

        dtype = torch.bfloat16 if device.type == "cuda" and self.cfg.systems.precision != "fp32" else torch.float32
        return load_final_norm(self.cfg.job.target).to(device, dtype).requires_grad_(False)

    def with_init_applied(self, note: str) -> ResolvedRun:
        """This run, its --drafter-init record saying how the weights were set (a fresh copy or a resume)."""
        if not self.drafter_init:
            return self
        record = {**self.drafter_init["record"], "applied": note}
        return dataclasses.replace(self, drafter_init={**self.drafter_init, "record": record})

    def record(self, world: int) -> dict:
        """RUN/config.json and each checkpoint's train_config.json."""
        return {
            "train": to_dict(self.cfg),
            "drafter": self.drafter_config.to_hf_dict(),
            "mask_token": {"id": self.mask_token_id, "source": self.mask_token_source},
            "layer_types_source": self.layer_types_source,
            "drafter_init": self.drafter_init["record"] if self.drafter_init else {"mode": "random"},
            "context_scale": (self.context_scale["record"] if self.context_scale else
                              {"mode": self.cfg.drafter.context_scale} if self.cfg.drafter.context_scale == "none" else
                              {"mode": self.cfg.drafter.context_scale, "source": "the checkpoint's buffer (resumed)"}),
            "world_size": world,
            "store": dict(self.store_record),
        }


__all__ = ["ResolvedRun"]
