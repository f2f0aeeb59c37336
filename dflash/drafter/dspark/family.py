"""DSpark as the stages see it: DFlash plus a Markov head and a confidence head, trained against the
target's distribution, which it reads from the store (docs/DESIGN.md §12)."""

from __future__ import annotations

from dflash.drafter.family import DrafterFamily, LossInputs, StoreNeeds
from dflash.errors import ConfigError, StoreError


def require_final_hidden(manifest: dict, path) -> None:
    """Refuse a store without the target's last hidden state (what DSpark trains on), before a run starts."""
    if manifest.get("final_hidden") is not True:
        raise StoreError(
            f"the store {path} has no final hidden states; DSpark needs them (it recomputes the target's full "
            "next-token distribution from the last layer's output): recapture with `dflash precompute "
            "--final-hidden` (into a new --out, or with --overwrite), train against the stored top-k only with "
            "--tv-source topk (a cheaper, truncated target distribution), or train this store with --arch dflash "
            "or dflash2."
        )


class DSparkFamily(DrafterFamily):
    name = "dspark"
    summary = "a Markov head and a confidence head; exported as Qwen3DSparkModel, docs/DESIGN.md §12"
    heads_outside_forward = True  # the heads run in the loss, after the forward

    @property
    def architectures(self) -> tuple[str, ...]:
        from dflash.drafter.dspark.model import ARCHITECTURE

        return (ARCHITECTURE, "DSparkDraftModel")  # SpecForge names a DSpark drafter DSparkDraftModel

    @property
    def knobs(self) -> tuple[str, ...]:
        from dflash.drafter.dspark.model import KNOBS

        return KNOBS

    def options(self) -> type:
        from dflash.drafter.dspark.options import DSparkOptions

        return DSparkOptions

    def config_class(self) -> type:
        from dflash.drafter.dspark.model import DSparkConfig

        return DSparkConfig

    def drafter_class(self) -> type:
        from dflash.drafter.dspark.model import DSparkDrafter

        return DSparkDrafter

    def needs(self, options) -> StoreNeeds:
        """The target's distribution: recomputed from its final hidden state and norm, or the stored top-k."""
        full = options.tv_source == "final_hidden"
        return StoreNeeds(final_hidden=full, topk=not full, final_norm=full)

    def check(self, cfg, store) -> None:
        o = cfg.dspark
        if cfg.objective.kd_weight > 0:
            raise ConfigError(f"--kd-weight {cfg.objective.kd_weight} with --arch dspark: DSpark's own distance to the "
                              "target distribution replaces KD (--dspark-tv-weight); train with --kd-weight 0.")
        if o.tv_source == "topk" and not store.topk:
            raise ConfigError(f"--arch dspark --tv-source topk needs the stored top-k target log-probs, but store "
                              f"{cfg.job.store} was made with --topk 0; precompute with --topk K, or use --tv-source "
                              "final_hidden on a store made with --final-hidden.")
        if o.tv_source == "final_hidden":
            require_final_hidden(store.manifest, cfg.job.store)

    def loss(self, x: LossInputs):
        """CE + L1 distance to the target's distribution + the confidence head's BCE (dspark/loss.py)."""
        from dflash.drafter.dspark.loss import dspark_block_loss
        from dflash.drafter.labels import previous_tokens

        o = x.options
        prev = previous_tokens(x.labels, x.block_input_ids, x.block_size)
        return dspark_block_loss(x.drafter, x.hidden, x.lm_head, x.labels, x.loss_weight, prev, block_size=x.block_size,
                                 denom=x.denom, ce_weight=o.dspark_ce_weight, tv_weight=o.dspark_tv_weight,
                                 confidence_weight=o.dspark_confidence_weight, tv_source=o.tv_source,
                                 final_hidden=x.final_hidden, norm_weight=x.final_norm,
                                 eps=x.drafter.config.rms_norm_eps, topk_ids=x.topk_ids, topk_logprobs=x.topk_logprobs,
                                 chunk=x.chunk, label_index=x.label_index)

    def loss_sum(self, stats, cfg) -> float:
        o = cfg.dspark
        return (o.dspark_ce_weight * stats.ce_sum + o.dspark_tv_weight * stats.tv_sum
                + o.dspark_confidence_weight * stats.conf_sum)

    def metrics(self, stats, weight_sum: float) -> dict:
        return {"tv": stats.tv_sum / weight_sum, "confidence_bce": stats.conf_sum / weight_sum}

    def predictions(self, drafter, hidden, lm_head, labels, block_input_ids, block_size: int):
        """lm_head plus the Markov bias of the true previous token."""
        from dflash.drafter.dspark.loss import dspark_predictions
        from dflash.drafter.labels import previous_tokens

        return dspark_predictions(drafter, hidden, lm_head, labels, previous_tokens(labels, block_input_ids, block_size))

    def draft(self, drafter, hidden, lm_head, anchor, confidence_threshold: float | None):
        """With `confidence_threshold` the confidence head picks how many drafts the target verifies, as vLLM's
        `dspark_confidence_threshold` does (model.verify_capacity); the rest are dropped unverified."""
        from dflash.drafter.dspark.model import verify_capacity

        if confidence_threshold is None:
            return super().draft(drafter, hidden, lm_head, anchor, None)
        proposals, conf = drafter.propose_with_confidence(hidden, lm_head, anchor.view(1))
        B = drafter.config.block_size
        return proposals[0], (int(verify_capacity(conf, confidence_threshold)[0]) if conf is not None else B - 1)

    def export_check(self, exported, reference, batch, lm_head) -> tuple[float, bool]:
        """(max |difference| of the Markov-biased logits and the confidence logits after random predecessors,
        whether the served walks propose the same tokens)."""
        import torch

        B = reference.config.block_size
        ha, hb = exported(*batch)[:, 1:B], reference(*batch)[:, 1:B]
        prev = torch.randint(0, reference.config.vocab_size, ha.shape[:2], generator=torch.Generator().manual_seed(2))
        diff = float((exported.head_logits(ha, lm_head, prev) - reference.head_logits(hb, lm_head, prev)).abs().max())
        ca, cb = exported.confidence(ha, prev), reference.confidence(hb, prev)
        if (ca is None) != (cb is None):
            return diff, False
        if ca is not None:
            diff = max(diff, float((ca - cb).abs().max()))
        anchor = torch.zeros(1, dtype=torch.long)
        return diff, bool((exported.propose(ha, lm_head, anchor) == reference.propose(hb, lm_head, anchor)).all())


FAMILY = DSparkFamily()

__all__ = ["FAMILY", "DSparkFamily", "require_final_hidden"]
