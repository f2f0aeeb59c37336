"""`--ema-decay d`: an exponential moving average of the drafter's trained weights, e <- d*e + (1-d)*w after
every optimizer step; the drafter that is evaluated during training, checkpointed and exported is e.

The optimizer keeps training w.  e lives beside each trainable parameter, in fp32 on its device (sharded
as the parameter is under FSDP2), and starts at the weights of step 0: with that warm start no bias
correction is needed.  A checkpoint's model.safetensors holds e, so `dflash eval`, `dflash export` and
anything else reading a checkpoint get the average without knowing of it; train_state.pt's
`trained_model` holds w, which a resumed run trains on.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager, nullcontext

import torch


def trainable(model: torch.nn.Module) -> tuple[list[str], list[torch.nn.Parameter]]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [n for n, _ in named], [p for _, p in named]


def _copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    # In place into the parameters' storage, one tensor at a time: a compiled drafter keeps its graphs (new
    # Parameter objects would fail its guards), and copy_ works on FSDP2's DTensors, _foreach_copy_ does not.
    with torch.no_grad():
        for d, s in zip(dst, src):
            d.copy_(s)


class WeightEMA:
    """The average e of a drafter's trainable parameters (`update` after each optimizer step)."""

    def __init__(self, model: torch.nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay {decay} is not in (0, 1)")
        self.decay = decay
        self.names, params = trainable(model)
        self.shadow = [p.detach().float().clone() for p in params]

    def update(self, model: torch.nn.Module) -> None:
        """e <- d*e + (1-d)*w, one fused kernel over all parameters."""
        with torch.no_grad():
            torch._foreach_lerp_(self.shadow, [p.detach().float() for p in trainable(model)[1]], 1.0 - self.decay)

    @contextmanager
    def swapped(self, model: torch.nn.Module):
        """The model with e in its parameters; the trained weights back, bit for bit, on leaving."""
        params = trainable(model)[1]
        trained = [p.detach().clone() for p in params]
        _copy(params, self.shadow)
        try:
            yield model
        finally:
            _copy(params, trained)

    def state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The model's full state (TrainStep.state_dict's form: unsharded, in host memory, its buffers too)
        with e as its parameters; collective under FSDP2 (every rank calls it)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        on_cpu = self.shadow[0].device.type == "cpu"
        with self.swapped(model):
            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            # On the CPU those may be the parameters themselves, which leaving the swap overwrites.
            return {k: v.detach().clone() for k, v in state.items()} if on_cpu else state

    def load_state_dict(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        """e from `state` (this class's state_dict form); the model's own weights are left as they are.
        Loaded through the model, so that FSDP2 shards e as it shards the parameters."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        names, params = trainable(model)
        missing = [n for n in names if n not in state]
        if missing:
            raise KeyError(f"EMA state lacks {missing[:5]}")
        trained = [p.detach().clone() for p in params]
        set_model_state_dict(model, {n: state[n] for n in names},
                             options=StateDictOptions(full_state_dict=True, strict=False))
        self.names, self.shadow = names, [p.detach().float().clone() for p in params]
        _copy(params, trained)


def applied(ema: WeightEMA | None, model: torch.nn.Module):
    """`ema.swapped(model)`, or the model as it is without an average."""
    return ema.swapped(model) if ema is not None else nullcontext(model)


def trained_weights(state: dict) -> dict[str, torch.Tensor]:
    """The weights a run resumes training on, from a checkpoint's state ({"model": model.safetensors,
    **train_state.pt}): those of model.safetensors unless it holds an average."""
    return state.get("trained_model", state["model"])


def resumed(model: torch.nn.Module, decay: float, state: dict, say: bool = True) -> WeightEMA | None:
    """The average a resumed run goes on with, exactly as the checkpoint left it; a checkpoint written
    without one starts it from the trained weights (call after loading them) and says so on stderr."""
    saved = "trained_model" in state
    if decay and saved:
        ema = WeightEMA(model, decay)
        ema.load_state_dict(model, state["model"])
        return ema
    step = state["step"]
    if decay:
        if say:
            print(f"warning: the checkpoint of step {step} holds no weight average; --ema-decay {decay} starts it "
                  "from the checkpoint's weights.", file=sys.stderr, flush=True)
        return WeightEMA(model, decay)
    if saved and say:
        print(f"note: the checkpoint of step {step} holds a weight average (--ema-decay); this run trains on from "
              "the checkpoint's trained weights without one.", file=sys.stderr, flush=True)
    return None


__all__ = ["WeightEMA", "applied", "resumed", "trainable", "trained_weights"]
