"""The DFlash drafter: a few Qwen3-style decoder layers whose block queries attend to target features.

Semantics follow z-lab's DFlashDraftModel (docs/DESIGN.md §2) so an export loads in vLLM / SGLang:

    ctx = hidden_norm(fc(concat of the chosen target layers' hidden states))     # [R, S, H]
    per layer:  x = input_layernorm(h)
                q = rope(q_norm(q_proj(x)))                                       # block tokens only
                k = rope(k_norm(k_proj(cat[ctx, x]))),  v = v_proj(cat[ctx, x])   # same weights
                h = h + o_proj(attention(q, k, v, mask));  h = h + mlp(post_attention_layernorm(h))
    out = norm(h)

The context has no residual stream: every layer re-projects the same `ctx`. Training packs many blocks
and samples into a row and relies on a block-sparse mask (`dflash.masks`); inference keeps a per-layer
cache of the context keys/values (`DraftCache`) and attends one block to all of it.

Init: linear weights ~ N(0, 0.02), norm weights = 1 (Qwen3's `initializer_range` convention).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash.masks import TiledMask, tiled_sdpa
from dflash.target_model.files import engine_layer_problem  # noqa: F401  (re-exported: train and export ask it here)

INIT_STD = 0.02
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
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


def layer_mask(mask, layer_type: str):
    """The mask of one layer: masks.to_block_mask / to_dense_mask give one mask (full layers only) or
    {"full_attention": m, "sliding_attention": m} for metadata built with a sliding window."""
    if isinstance(mask, dict):
        if layer_type not in mask:
            raise ValueError(f"no {layer_type} mask among {sorted(mask)}")
        return mask[layer_type]
    if layer_type == SLIDING_ATTENTION:
        raise ValueError("a drafter with sliding-window layers needs the per-layer masks of "
                         "masks.mask_metadata(..., sliding_window=W), not a single full-attention mask")
    return mask


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm (fp32 statistics); returns the input dtype so attention inputs agree in dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin for arbitrary absolute positions; inv_freq is a non-persistent buffer (not exported)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("inv_freq", torch.empty(cfg.head_dim // 2), persistent=False)
        self.attention_scaling = 1.0
        self.reset_buffers()

    def reset_buffers(self, device=None) -> None:
        cfg = self.cfg
        device = device or self.inv_freq.device
        if device.type == "meta":
            return
        if cfg.rope_scaling is None:
            exps = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64, device=device).float() / cfg.head_dim
            inv_freq, scale = 1.0 / (cfg.rope_theta ** exps), 1.0
        else:
            # Scaled variants (linear, yarn, llama3, ...) come from transformers' own formulas.
            from transformers import Qwen3Config
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            hf = Qwen3Config(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                             head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
                             rope_parameters=cfg.rope_parameters())
            inv_freq, scale = ROPE_INIT_FUNCTIONS[cfg.rope_scaling["rope_type"]](hf, device)
        self.inv_freq = inv_freq.float().to(device)
        self.attention_scaling = float(scale)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [R, N, hd/2]
        emb = torch.cat([freqs, freqs], -1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], -1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [R, heads, N, hd]; cos/sin [R, N, hd] (broadcast over heads)."""
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    return x * cos + rotate_half(x) * sin


_compiled_flex = None
# Triton tile sizes for flex_attention's kernels (BLOCK_M, BLOCK_N, num_warps, ... as torch names them),
# read when the drafter is compiled; empty = torch's defaults.  bench/train_step.py measures choices.
FLEX_KERNEL_OPTIONS: dict = {}


def _flex(q, k, v, block_mask, scale):
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    kw = {"kernel_options": dict(FLEX_KERNEL_OPTIONS)} if FLEX_KERNEL_OPTIONS and q.is_cuda else {}
    # Eager flex_attention is a dense reference implementation; on GPU outside a compiled drafter use
    # a compiled kernel. Inside torch.compile of the drafter the plain function is traced directly.
    if q.is_cuda and not torch.compiler.is_compiling():
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention)
        return _compiled_flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True, **kw)
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True, **kw)


def attend(q, k, v, mask, scale: float) -> torch.Tensor:
    """q [R,h,Q,d], k/v [R,kvh,K,d]; mask: BlockMask, bool [R,1,Q,K] or None (all visible)."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    if isinstance(mask, TiledMask):
        return tiled_sdpa(q, k, v, mask, scale)
    if isinstance(mask, torch.Tensor):
        # a packed row's sparse mask: only the key tiles it sees (eager only: the tile count is data)
        out = None if torch.compiler.is_compiling() else tiled_sdpa(q, k, v, mask, scale)
        if out is not None:
            return out
        # SDPA turns rows with no visible key into NaN (and NaN gradients); let them see everything,
        # then zero their output, which is what flex_attention returns for an empty row.
        rows_on = mask.any(-1, keepdim=True)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~rows_on, scale=scale, enable_gqa=True)
        return out.masked_fill(~rows_on, 0.0)
    return _flex(q, k, v, mask, scale)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        H, hd, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(H, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(H, self.n_kv * hd, bias=bias)
        self.v_proj = nn.Linear(H, self.n_kv * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, H, bias=bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def project_kv(self, x, rope):
        """Keys (k_norm, then RoPE) and values [R, kvh, N, hd] of the tokens x [R, N, H]."""
        R, N, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(R, N, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(R, N, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rope(k, *rope), v

    def forward(self, x, ctx_kv, block_rope, mask):
        """x: normed block tokens [R, Q, H]; ctx_kv: (k, v) of the context, already projected."""
        R, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(R, Q, self.n_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, *block_rope)
        k_blk, v_blk = self.project_kv(x, block_rope)
        k = torch.cat([ctx_kv[0], k_blk], 2)
        v = torch.cat([ctx_kv[1], v_blk], 2)
        out = attend(q, k, v, mask, self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(R, Q, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        from transformers.activations import ACT2FN

        H, I = cfg.hidden_size, cfg.intermediate_size  # noqa: E741  (I: the intermediate size)
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)
        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, ctx_kv, block_rope, mask):
        h = h + self.self_attn(self.input_layernorm(h), ctx_kv, block_rope, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DraftCache:
    """Per-layer context keys/values [1, kvh, n, hd] (after k_norm and RoPE) for speculative decoding.

    Only accepted context enters the cache; block keys/values are recomputed every step.
    """

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.positions: torch.Tensor | None = None  # [1, n]: the cached tokens' positions (sliding layers)

    def __len__(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[2]

    @property
    def num_tokens(self) -> int:
        return len(self)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k[layer] is not None:
            k, v = torch.cat([self.k[layer], k], 2), torch.cat([self.v[layer], v], 2)
        self.k[layer], self.v[layer] = k, v
        return k, v

    def add_positions(self, positions: torch.Tensor) -> torch.Tensor:
        self.positions = positions if self.positions is None else torch.cat([self.positions, positions], 1)
        return self.positions

    def crop(self, n: int) -> None:
        """Keep the first n context tokens."""
        for i in range(len(self.k)):
            if self.k[i] is not None:
                self.k[i], self.v[i] = self.k[i][:, :, :n], self.v[i][:, :, :n]
        if self.positions is not None:
            self.positions = self.positions[:, :n]


@torch.no_grad()
def init_linears_and_norms(modules) -> None:
    """N(0, 0.02) weights and zero biases for each linear, unit weights for each RMSNorm, in order."""
    for m in modules:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=INIT_STD)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, RMSNorm):
            nn.init.ones_(m.weight)


class DFlashDrafter(nn.Module):
    layer_cls = DecoderLayer  # dflash.dflash2 swaps in its convolved layer

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_features * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_cls(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """N(0, 0.02) linears, unit norms, fresh RoPE buffer (also after meta-device construction)."""
        init_linears_and_norms(self.modules())
        self.rotary_emb.reset_buffers(buffer_device)

    def _check_features(self, ctx_hidden: torch.Tensor) -> None:
        if ctx_hidden.shape[-1] != self.fc.in_features:
            raise ValueError(
                f"context features have width {ctx_hidden.shape[-1]}, the drafter expects "
                f"{self.config.num_features} target layers x hidden {self.config.hidden_size} = {self.fc.in_features}")

    def _context(self, ctx_hidden: torch.Tensor) -> torch.Tensor:
        # Under autocast the bf16 features go straight into fc; otherwise match the weights' dtype.
        if not torch.is_autocast_enabled(ctx_hidden.device.type):
            ctx_hidden = ctx_hidden.to(self.fc.weight.dtype)
        return self.hidden_norm(self.fc(ctx_hidden))

    def forward(self, ctx_hidden, block_embeds, ctx_positions, block_positions, mask) -> torch.Tensor:
        """ctx_hidden [R,S,L*H], block_embeds [R,Q,H], positions [R,S] / [R,Q], mask: BlockMask or
        bool [R,1,Q,S+Q], or {layer type: either} for a drafter with sliding layers (dflash.masks) ->
        hidden states [R,Q,H] after the final norm."""
        self._check_features(ctx_hidden)
        if not ctx_hidden.is_cuda and torch.is_grad_enabled():
            # flex_attention has no backward on CPU: train there through SDPA with the same mask.
            from dflash.masks import block_mask_to_dense

            def dense(m):
                return m if m is None or isinstance(m, (torch.Tensor, TiledMask)) else block_mask_to_dense(m)

            mask = {k: dense(v) for k, v in mask.items()} if isinstance(mask, dict) else dense(mask)
        ctx = self._context(ctx_hidden)
        ctx_rope = self.rotary_emb(ctx_positions)
        block_rope = self.rotary_emb(block_positions)
        h = block_embeds.to(self.norm.weight.dtype)  # residual stream in the parameters' dtype
        for layer, kind in zip(self.layers, self.config.layer_types):
            ctx_kv = layer.self_attn.project_kv(ctx, ctx_rope)
            h = layer(h, ctx_kv, block_rope, layer_mask(mask, kind))
        return self.norm(h)

    def new_cache(self) -> DraftCache:
        return DraftCache(len(self.layers))

    def forward_step(self, new_ctx_hidden, block_embeds, ctx_positions, block_positions,
                     cache: DraftCache) -> torch.Tensor:
        """One drafting step: append the newly accepted context [R,n,L*H] (n may be 0) at
        `ctx_positions` [R,n] to `cache`, then let the block [R,B,H] at `block_positions` [R,B] attend
        to all cached context and to itself (bidirectional); on a sliding layer a block query at
        position p sees only the keys at positions p - W < j <= p. Returns [R,B,H] after the final norm."""
        self._check_features(new_ctx_hidden)
        n = new_ctx_hidden.shape[1]
        ctx = self._context(new_ctx_hidden) if n else None
        ctx_rope = self.rotary_emb(ctx_positions) if n else None
        block_rope = self.rotary_emb(block_positions)
        h = block_embeds.to(self.norm.weight.dtype)
        kv_pos = cache.add_positions(ctx_positions) if n else cache.positions
        sliding = None
        if self.config.has_sliding:
            kv_pos = block_positions[:, :0] if kv_pos is None else kv_pos
            j = torch.cat([kv_pos, block_positions], 1)[:, None, None, :]  # [R, 1, 1, ctx + B]
            p = block_positions[:, None, :, None]  # [R, 1, B, 1]
            sliding = (j <= p) & (j > p - self.config.sliding_window)
        for i, (layer, kind) in enumerate(zip(self.layers, self.config.layer_types)):
            if n:
                ctx_kv = cache.append(i, *layer.self_attn.project_kv(ctx, ctx_rope))
            elif cache.k[i] is not None:
                ctx_kv = (cache.k[i], cache.v[i])
            else:  # no context at all: empty keys
                R, a = h.shape[0], layer.self_attn
                empty = h.new_zeros(R, a.n_kv, 0, a.head_dim)
                ctx_kv = (empty, empty)
            h = layer(h, ctx_kv, block_rope, sliding if kind == SLIDING_ATTENTION else None)
        return self.norm(h)


def drafter_logits(hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
    """Logits through the target's frozen lm_head (no target final norm: the drafter has its own)."""
    return F.linear(hidden, lm_head_weight.to(hidden.dtype))


def state_dict_keys(num_layers: int, attention_bias: bool = False) -> list[str]:
    """The exported tensor names (export.py and tests check against these)."""
    keys = ["fc.weight", "hidden_norm.weight", "norm.weight"]
    for i in range(num_layers):
        p = f"layers.{i}."
        keys += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            keys.append(p + f"self_attn.{proj}.weight")
            if attention_bias:
                keys.append(p + f"self_attn.{proj}.bias")
        keys += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        keys += [p + f"mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
    return keys
