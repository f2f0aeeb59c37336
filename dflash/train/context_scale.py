"""`--context-scale rms`: a fixed per-input-channel preconditioner of the drafter's fc (docs/DESIGN.md §2).

Targets with massive activations (SmolLM2-135M: 5 channels of a captured layer hold 54-65% of its squared
norm, and the captured layers' scales differ 10x) feed fc inputs whose channels differ by orders of
magnitude; Adam moves every weight by about lr per step whatever its input's scale, so the few huge
channels dominate fc's output and the rest of the context is learned slowly.  Dividing each channel by its
RMS over the store puts every channel at about unit scale.

The scale is measured once, at the start of a fresh run (preflight), over the first `MAX_TOKENS` context
tokens of the store's first samples in sample-id order, each sample's position 0 left out (the attention
sink, an outlier of its own); an RMS below `FLOOR` x its layer's median channel RMS is raised to that
(a dead channel would otherwise get an enormous factor).  The factor kept is 1/rms rounded to the nearest
power of two: within a factor sqrt(2) of unit scale, which is all a preconditioner needs, and exact in any
dtype, so that fc(x * s) and the export's folded fc.weight * s agree bit for bit in bf16 as in fp32.  The
drafter keeps it as the buffer `context_scale`; a resumed run loads it from its checkpoint, never anew.
"""

from __future__ import annotations

import torch

from dflash.errors import ConfigError

MAX_TOKENS = 65536
FLOOR = 1e-2  # relative to the layer's median channel RMS
SKIP_POSITIONS = 1  # leading positions of each sample left out (position 0: the attention sink)


def context_sum_squares(store, max_tokens: int = MAX_TOKENS, skip: int = SKIP_POSITIONS
                        ) -> tuple[torch.Tensor, int, int]:
    """(sum of squares [L*H] in float64, tokens counted, samples read) over the tokens `context_rms` measures."""
    width = store.hidden_size * store.num_layers
    total = torch.zeros(width, dtype=torch.float64)
    tokens = samples = 0
    for sid in store.sample_ids():
        if tokens >= max_tokens:
            break
        h = store.read(sid, fields=("hidden",))["hidden"][skip:max_tokens - tokens + skip]
        samples += 1
        if len(h):
            total += h.double().pow(2).sum(0)
            tokens += len(h)
    return total, tokens, samples


def context_rms(store, max_tokens: int = MAX_TOKENS, skip: int = SKIP_POSITIONS) -> tuple[torch.Tensor, int, int]:
    """(each context-feature channel's RMS [L*H] float64, tokens, samples) over the store's first `max_tokens`
    tokens past each sample's first `skip` positions."""
    total, tokens, samples = context_sum_squares(store, max_tokens, skip)
    if not tokens:
        raise ConfigError(f"--context-scale rms needs context tokens past position {skip - 1} of a sample, and the "
                          f"first {samples} sample(s) of store {store.path} have none; train with --context-scale none.")
    return (total / tokens).sqrt(), tokens, samples


def scale_from_rms(rms: torch.Tensor, num_layers: int, floor: float = FLOOR) -> torch.Tensor:
    """The factors [L*H] float32: 1/rms, each rms raised to at least `floor` x its layer's median channel RMS
    (and 1e-12), rounded to the nearest power of two."""
    per_layer = rms.double().view(num_layers, -1)
    low = (per_layer.median(dim=1, keepdim=True).values * floor).clamp_min(1e-12)
    clamped = torch.maximum(per_layer, low).reshape(-1)
    return torch.exp2(torch.round(-torch.log2(clamped))).float()


def compute(store) -> dict:
    """{"scale": the factors [L*H] float32, "record": what RUN/config.json says of them} for a fresh run."""
    rms, tokens, samples = context_rms(store)
    scale = scale_from_rms(rms, store.num_layers)
    per_layer = rms.view(store.num_layers, -1)
    record = {"mode": "rms", "tokens": tokens, "samples": samples, "skipped_positions": SKIP_POSITIONS,
              "floor": FLOOR, "rounding": "power of two",
              "layers": {str(layer): {"rms_median": round(float(r.median()), 4), "rms_max": round(float(r.max()), 4)}
                         for layer, r in zip(store.target_layer_ids, per_layer)}}
    return {"scale": scale, "record": record}


def checkpoint_mode(model_state: dict) -> str:
    """The --context-scale a checkpoint's model state was trained with: its buffer is the record."""
    from dflash.drafter.dflash.model import CONTEXT_SCALE

    return "rms" if any(k.split(".")[-1] == CONTEXT_SCALE for k in model_state) else "none"


def change(checkpoint, model_state: dict, asked: str) -> str | None:
    """Why a run asking for --context-scale `asked` cannot resume `checkpoint`, or None."""
    saved = checkpoint_mode(model_state)
    if saved == asked:
        return None
    return (f"checkpoint {checkpoint} was trained with --context-scale {saved} and this run asks for --context-scale "
            f"{asked}: fc's weights were learned against context features {'scaled by' if saved == 'rms' else 'without'} "
            "the per-channel factor, so switching it midway would change what the drafter computes (and the "
            f"factor is measured only at the start of a fresh run); resume with --context-scale {saved}, or start "
            "a new --out directory to train with the other setting.")


__all__ = ["FLOOR", "MAX_TOKENS", "SKIP_POSITIONS", "change", "checkpoint_mode", "compute", "context_rms",
           "context_sum_squares", "scale_from_rms"]
