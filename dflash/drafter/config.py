"""The drafter's configuration, and its round trip through the export's config.json (z-lab's
DFlashDraftModel format: a Qwen3 config plus a `dflash_config`, docs/DESIGN.md §2)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dflash.drafter.masks import FULL_ATTENTION, SLIDING_ATTENTION

INIT_STD = 0.02
_LAYER_TYPES = {"full": FULL_ATTENTION, FULL_ATTENTION: FULL_ATTENTION,
                "sliding": SLIDING_ATTENTION, SLIDING_ATTENTION: SLIDING_ATTENTION}


def _get(cfg: Any, name: str, default=None):
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def _rope_of(cfg: Any) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from a transformers 4 or 5 config (object or dict)."""
    params = _get(cfg, "rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type parameters
        params = params["full_attention"]
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta", _get(cfg, "rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = _get(cfg, "rope_theta", 10000.0)
        scaling = dict(_get(cfg, "rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    return float(theta), scaling


@dataclass
class DrafterConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    max_position_embeddings: int = 40960
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: dict | None = None  # transformers' rope parameters minus rope_theta; None = default
    attention_bias: bool = False
    hidden_act: str = "silu"
    # Per drafter layer "full_attention" or "sliding_attention" ("full" / "sliding" accepted); None = all
    # full.  A sliding layer's block query at position p sees keys at p - W < j <= p (docs/DESIGN.md §4).
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    extra: dict = field(default_factory=dict)  # unknown export fields, kept for a faithful round trip

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one target layer")
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        types = self.layer_types if self.layer_types is not None else [FULL_ATTENTION] * self.num_hidden_layers
        if len(types) != self.num_hidden_layers:
            raise ValueError(f"layer_types needs one entry per drafter layer: {len(types)} given for "
                             f"{self.num_hidden_layers} layers")
        bad = [t for t in types if t not in _LAYER_TYPES]
        if bad:
            raise ValueError(f"layer_types {bad} are not full or sliding (full_attention / sliding_attention)")
        self.layer_types = [_LAYER_TYPES[t] for t in types]
        if self.sliding_window is not None:
            self.sliding_window = int(self.sliding_window)
        if self.has_sliding and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError(f"sliding layers need a sliding_window of at least 1 token, got {self.sliding_window}")

    @property
    def has_sliding(self) -> bool:
        return SLIDING_ATTENTION in (self.layer_types or ())

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_target(cls, target_config, num_layers: int, block_size: int = 16,
                    target_layer_ids: list[int] | None = None, mask_token_id: int | None = None,
                    layer_types: list[str] | None = None, sliding_window: int | None = None) -> DrafterConfig:
        """Copy the target's layer shape (as z-lab does); `num_layers` drafter layers."""
        from dflash.target_model.files import default_target_layers

        tc = target_config
        if hasattr(tc, "get_text_config"):
            tc = tc.get_text_config()
        elif isinstance(tc, dict) and tc.get("text_config"):
            tc = tc["text_config"]
        if mask_token_id is None:
            raise ValueError("mask_token_id must be an id of the target's embedding table")
        H, nh = _get(tc, "hidden_size"), _get(tc, "num_attention_heads")
        n_target = _get(tc, "num_hidden_layers")
        theta, scaling = _rope_of(tc)
        return cls(
            hidden_size=H,
            num_hidden_layers=num_layers,
            num_attention_heads=nh,
            num_key_value_heads=_get(tc, "num_key_value_heads") or nh,
            head_dim=_get(tc, "head_dim") or H // nh,
            # MoE targets without a dense MLP width (Qwen3.5-MoE): 3 x hidden, the dense Qwen3 ratio
            intermediate_size=_get(tc, "intermediate_size") or 3 * H,
            vocab_size=_get(tc, "vocab_size"),
            num_target_layers=n_target,
            target_layer_ids=list(target_layer_ids) if target_layer_ids else default_target_layers(n_target, num_layers),
            mask_token_id=int(mask_token_id),
            block_size=block_size,
            max_position_embeddings=_get(tc, "max_position_embeddings", 40960),
            rms_norm_eps=_get(tc, "rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            attention_bias=bool(_get(tc, "attention_bias", False)),
            hidden_act=_get(tc, "hidden_act", "silu"),
            layer_types=list(layer_types) if layer_types else None,
            sliding_window=sliding_window,
        )

    def rope_parameters(self) -> dict:
        return {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}

    def to_hf_dict(self) -> dict:
        """The export config.json: a Qwen3 config plus the DFlash fields (z-lab's format)."""
        d = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            # Both spellings: transformers 5 reads rope_parameters, older loaders rope_theta/rope_scaling.
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "rope_parameters": self.rope_parameters(),
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "initializer_range": INIT_STD,
            "tie_word_embeddings": False,
            # vLLM (_resolve_layer_attention) and SGLang read these: a sliding_attention layer is causal
            # with window sliding_window (counting the query's own token), a full_attention one is not.
            "use_sliding_window": self.has_sliding,
            "sliding_window": self.sliding_window,
            "max_window_layers": self.num_hidden_layers,
            "layer_types": list(self.layer_types),
            "use_cache": True,
            "dtype": "bfloat16",
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
                "block_size": self.block_size,
            },
        }
        d.update({k: v for k, v in self.extra.items() if k not in d})
        return d

    @classmethod
    def from_hf_dict(cls, d: dict) -> DrafterConfig:
        dc = d.get("dflash_config") or {}
        nh = d["num_attention_heads"]
        theta, scaling = _rope_of(d)
        known = {f.name for f in dataclasses.fields(cls)} | {
            "architectures", "model_type", "rope_parameters", "dflash_config", "attention_dropout",
            "initializer_range", "tie_word_embeddings", "use_sliding_window", "sliding_window",
            "max_window_layers", "use_cache", "dtype", "torch_dtype", "transformers_version",
            "eagle_aux_hidden_state_layer_ids"}
        return cls(
            hidden_size=d["hidden_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=nh,
            num_key_value_heads=d.get("num_key_value_heads") or nh,
            head_dim=d.get("head_dim") or d["hidden_size"] // nh,
            intermediate_size=d["intermediate_size"],
            vocab_size=d["vocab_size"],
            num_target_layers=d.get("num_target_layers", dc.get("num_target_layers")),
            target_layer_ids=dc.get("target_layer_ids", d.get("target_layer_ids")),
            mask_token_id=dc.get("mask_token_id", d.get("mask_token_id")),
            block_size=dc.get("block_size", d.get("block_size", 16)),
            max_position_embeddings=d.get("max_position_embeddings", 40960),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            attention_bias=bool(d.get("attention_bias", False)),
            hidden_act=d.get("hidden_act", "silu"),
            layer_types=d.get("layer_types"),
            sliding_window=d["sliding_window"] if d.get("sliding_window") is not None else dc.get("swa_window_size"),
            extra={k: v for k, v in d.items() if k not in known},
        )
