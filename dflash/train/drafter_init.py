"""`--drafter-init target`: the drafter's decoder layers start as copies of the target's last layers.

Drafter layer i takes target layer L - n + i (n drafter layers, L target layers).  The drafter's output
goes through the target's lm_head, as the output of the target's last layer does, so the layers nearest
the head are the ones whose weights already map a residual stream to next-token logits; the layers just
after the deepest captured one would be the other choice, but there are often fewer of them than drafter
layers (the embedded default captures [0, 2] of 4 layers for a 2-layer drafter; Qwen3-8B's default
reaches layer 33 of 36 for 5).  docs/DESIGN.md §2.

Copied where the target has a tensor of the same name and shape: the q/k/v/o projections (and their
biases), q_norm / k_norm, the SwiGLU MLP and the two layer norms.  `fc`, `hidden_norm`, the final
`norm` and anything else without a counterpart (a family's own modules) keep the default N(0, 0.02) /
unit init.  A target without q_norm / k_norm (Llama, Qwen2) leaves them at 1.  Anything else missing
or of another shape (an MoE or linear-attention layer, a gated q_proj) is refused before training.

Preflight plans the copy from the safetensors headers alone (`plan`); the training processes read the
tensors only on a fresh run (`load`): a resumed run keeps its checkpoint's weights.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from dflash.errors import ConfigError

INITS = ("random", "target")
# Without these a target layer is not the drafter's kind of layer (attention + dense SwiGLU MLP).
REQUIRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
            "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
            "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias", "self_attn.o_proj.bias",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
OPTIONAL = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
# Families whose RMSNorm multiplies by (1 + weight): their norm weights mean something else in the drafter's
# Qwen3-style norm, although the shapes agree.
ZERO_CENTRED_NORMS = ("gemma", "gemma2", "gemma3", "gemma3_text", "qwen3_next", "qwen3_5", "qwen3_5_text",
                      "qwen3_5_moe", "qwen3_5_moe_text")
RULE = "drafter layer i <- target layer L - n + i (the target's last n layers)"


def _drafter_shapes(drafter_config) -> dict[str, tuple[int, ...]]:
    from dflash.drafter import build_drafter

    with torch.device("meta"):
        model = build_drafter(drafter_config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _layer_prefix(weight_map: dict[str, str], target: Path) -> str:
    """What precedes `layers.<j>.` in the target's tensor names (`model.`, `model.language_model.`)."""
    prefixes = {m.group(1) for k in weight_map if (m := re.match(r"^(.*?)layers\.\d+\.input_layernorm\.", k))}
    embed = next((k[: -len("embed_tokens.weight")] for k in weight_map if k.endswith("embed_tokens.weight")), None)
    if embed in prefixes:
        return embed
    if len(prefixes) == 1:
        return prefixes.pop()
    raise ConfigError(f"--drafter-init target: cannot tell the decoder layers of target {target} from its tensor "
                      f"names (layer prefixes found: {sorted(prefixes) or 'none'}); train with --drafter-init random.")


def _refuse(target: Path, what: str) -> ConfigError:
    return ConfigError(f"--drafter-init target cannot start the drafter from target {target}: {what}. The drafter's "
                       "layers copy the target's shape (hidden size, heads, KV heads, head dim, intermediate size) "
                       "and are copied from the target's last --num-layers layers, which must be dense "
                       "full-attention layers of that shape; train with --drafter-init random (the default), or "
                       "with fewer --num-layers if only the last layers differ.")


def plan(target_dir: str, drafter_config, target_config) -> dict:
    """{drafter tensor: (target file, target tensor)} plus the record RUN/config.json keeps; a ConfigError
    naming the target file, the tensor and both shapes when a layer cannot be copied."""
    from safetensors import safe_open

    from dflash.target_model.files import _safetensors_index, _target_dir

    target = _target_dir(target_dir)
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    n, L = drafter_config.num_hidden_layers, drafter_config.num_target_layers
    if n > L:
        raise _refuse(target, f"the drafter has {n} layers and the target only {L}")
    weight_map = _safetensors_index(target)
    prefix = _layer_prefix(weight_map, target)
    types = list(getattr(text, "layer_types", None) or [])
    shapes = _drafter_shapes(drafter_config)
    copies, kept, layer_map = {}, sorted(k for k in shapes if not k.startswith("layers.")), {}
    for i in range(n):
        j = L - n + i
        layer_map[i] = j
        if j < len(types) and types[j] not in ("full_attention", "sliding_attention"):
            raise _refuse(target, f"its layer {j} (for drafter layer {i}) is {types[j]}, not attention")
        for name in sorted(k for k in shapes if k.startswith(f"layers.{i}.")):
            suffix = name[len(f"layers.{i}."):]
            src = f"{prefix}layers.{j}.{suffix}"
            if src not in weight_map:
                if suffix in REQUIRED:
                    raise _refuse(target, f"its layer {j} (for drafter layer {i}) has no {src} in its safetensors "
                                          f"(the drafter's {name} is {list(shapes[name])}); an MoE or "
                                          "linear-attention layer has none")
                kept.append(name)
                continue
            file = target / weight_map[src]
            with safe_open(str(file), framework="pt") as f:
                shape = tuple(f.get_slice(src).get_shape())
            if shape != shapes[name]:
                raise _refuse(target, f"{file} holds {src} of shape {list(shape)}, but the drafter's {name} is "
                                      f"{list(shapes[name])}")
            copies[name] = (str(file), src)
    model_type = getattr(text, "model_type", None)
    if model_type in ZERO_CENTRED_NORMS:  # after the layers: their mismatch is the more telling message
        raise _refuse(target, f"its model type {model_type} scales by (1 + weight) in its RMSNorms, the drafter by "
                              "the weight, so copied norms would mean something else")
    record = {"mode": "target", "rule": RULE, "layer_map": {str(i): j for i, j in layer_map.items()},
              "copied_per_layer": sorted({k.split(".", 2)[2] for k in copies}), "kept_default": kept}
    return {"copies": copies, "record": record}


def load(copies: dict[str, tuple[str, str]]) -> dict[str, torch.Tensor]:
    """The planned target tensors, in fp32, keyed by the drafter's names."""
    from safetensors import safe_open

    out, by_file = {}, {}
    for name, (file, src) in copies.items():
        by_file.setdefault(file, []).append((name, src))
    for file, pairs in by_file.items():
        with safe_open(file, framework="pt") as f:
            for name, src in pairs:
                out[name] = f.get_tensor(src).float()
    return out


__all__ = ["INITS", "RULE", "plan", "load"]
