"""Offline acceptance length on a held-out store: the training semantics, measured (docs/DESIGN.md §6).

The loader draws anchors from each held-out sample with (seed, epoch 0), so two evaluations of two
checkpoints see the same blocks; the drafter predicts every block in one packed forward, and a block's
acceptance length is 1 + the number of leading positions whose greedy prediction equals the stored
token (a position past the sample or not supervised ends the run).  Cheap enough for `train --eval-every`;
`dflash eval --store` calls the same function.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from dflash.drafter import attention, family_of
from dflash.drafter.labels import block_acceptance
from dflash.errors import StoreError
from dflash.train import loader as L


def summarize(taus: np.ndarray, block_size: int, correct: np.ndarray | None = None,
              valid: np.ndarray | None = None) -> dict:
    """tau statistics: mean, histogram over 1..B, and P(position k accepted) for k = 1..B-1."""
    B = block_size
    taus = np.asarray(taus, dtype=np.int64)
    n = max(len(taus), 1)
    hist = np.bincount(taus, minlength=B + 1)[1 : B + 1]
    out = {
        "tau": float(taus.mean()) if len(taus) else float("nan"),
        "num_blocks": int(len(taus)),
        "block_size": B,
        # acceptance[k-1]: share of blocks whose first k proposals were all accepted
        "acceptance": [float((taus >= k + 1).sum() / n) for k in range(1, B)],
        "tau_hist": [int(c) for c in hist],
    }
    if correct is not None:
        out["accuracy"] = [float(c / v) if v else None for c, v in zip(correct[1:], valid[1:])]
    return out


def check_store(store, cfg) -> None:
    """StoreError unless `store` holds the drafter's target layers at its width and has samples."""
    if store.hidden_size != cfg.hidden_size or list(store.target_layer_ids) != list(cfg.target_layer_ids):
        raise StoreError(
            f"store {store.path} holds target layers {store.target_layer_ids} of hidden size {store.hidden_size}, "
            f"but the drafter reads layers {cfg.target_layer_ids} of hidden size {cfg.hidden_size}; evaluate on "
            "a held-out store precomputed from the same target with the same --target-layers."
        )
    if len(store) == 0:
        raise StoreError(f"store {store.path} has no committed samples; run `dflash precompute` to completion.")


def predictions(drafter, hidden: torch.Tensor, lm_head: torch.Tensor, labels: torch.Tensor,
                block_input_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """[R, Q] the drafter's proposals where there is a label (-1 elsewhere), as its family serves them
    (DrafterFamily.predictions: up to a block's first miss, the served walk's)."""
    return family_of(drafter.config).predictions(drafter, hidden, lm_head, labels, block_input_ids, block_size)


@torch.no_grad()
def offline_tau(drafter, embed: torch.Tensor, lm_head: torch.Tensor, store, *, num_anchors: int = 64,
                seed: int = 0, max_samples: int | None = None, token_budget: int | None = None,
                block_budget: int | None = None, num_shapes: int = 3, progress: bool = True) -> dict:
    """Greedy acceptance length of `drafter` on a held-out store (docs/DESIGN.md §3, §6).

    num_shapes: padded (context, block) shapes per stream (LoaderSpec); a compiled drafter compiles each
    one it meets, so training passes 1 for its evals (padding changes no result).

    embed / lm_head: the target's frozen [V, H] tensors (they are moved to the drafter's device).
    Anchors come from dflash.train.loader with (seed, epoch 0): the same blocks for every checkpoint.
    Returns {tau, num_blocks, num_samples, block_size, acceptance [B-1], accuracy [B-1], tau_hist [B]}.
    """
    cfg = drafter.config
    B = cfg.block_size
    check_store(store, cfg)
    param = next(drafter.parameters())
    device = param.device
    longest = int(store.lengths().max())
    # Whole samples as context (no truncation) unless the caller fixes the shapes (a compiled drafter).
    spec = L.LoaderSpec(
        block_size=B,
        num_anchors=num_anchors,
        token_budget=token_budget or L.round_up(longest),
        block_budget=block_budget or L.round_up(num_anchors * B),
        rows_per_batch=1,
        mask_token_id=cfg.mask_token_id,
        seed=seed,
        num_shapes=num_shapes,
        sliding_window=cfg.sliding_window if cfg.has_sliding else None,  # the training masks, per layer
    )
    ds = L.PackedDataset(store, spec)
    plan = ds.plan(0)
    embed = embed.to(device)
    lm_head = lm_head.to(device)
    taus, rights, valids, n_samples = [], [], [], 0
    was_training = drafter.training
    drafter.eval()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    bar = tqdm(plan.batches, desc="offline tau", unit="batch", disable=not progress, leave=False)
    try:
        for rows in bar:
            if max_samples is not None:  # a prefix of the (seeded) plan, cut at exactly max_samples
                rows = [r[: max(0, max_samples - n_samples - sum(len(x) for x in rows[:i]))]
                        for i, r in enumerate(rows)]
                rows = [r for r in rows if len(r)]
                if not rows:
                    break
            b = ds.build(0, rows).to(device).dequantised()
            n_samples += b.num_samples
            mask = attention.mask_for(b.mask, device, compiled=attention.is_compiled(drafter))
            with autocast:
                hidden = drafter(b.ctx_hidden, F.embedding(b.block_input_ids, embed), b.ctx_positions,
                                 b.block_positions, mask)
            labels = b.labels
            preds = predictions(drafter, hidden, lm_head, labels, b.block_input_ids, B)
            tau, right, valid = block_acceptance(preds, labels, B)
            taus.append(tau.cpu())
            rights.append(right.sum(0).cpu())
            valids.append(valid.sum(0).cpu())
            bar.set_postfix(tau=f"{float(torch.cat(taus).float().mean()):.3f}")
    finally:
        drafter.train(was_training)
    all_tau = torch.cat(taus).numpy() if taus else np.zeros(0, np.int64)
    out = summarize(all_tau, B, torch.stack(rights).sum(0).numpy(), torch.stack(valids).sum(0).numpy())
    out["num_samples"] = n_samples
    return out
