"""The DFlash drafter: a few Qwen3-style decoder layers whose block queries attend to target features.

Semantics follow z-lab's DFlashDraftModel (docs/DESIGN.md §2) so an export loads in vLLM / SGLang:

    ctx = hidden_norm(fc(concat of the chosen target layers' hidden states))     # [R, S, H]
    per layer:  x = input_layernorm(h)
                q = rope(q_norm(q_proj(x)))                                       # block tokens only
                k = rope(k_norm(k_proj(cat[ctx, x]))),  v = v_proj(cat[ctx, x])   # same weights
                h = h + o_proj(attention(q, k, v, mask));  h = h + mlp(post_attention_layernorm(h))
    out = norm(h)

The context has no residual stream: every layer re-projects the same `ctx`. Training packs many blocks
and samples into a row and relies on a block-sparse mask (`dflash.drafter.masks`); inference keeps a per-layer
cache of the context keys/values (`DraftCache`) and attends one block to all of it.

Init: linear weights ~ N(0, 0.02), norm weights = 1 (Qwen3's `initializer_range` convention).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import dflash.drafter.attention as attention
from dflash.drafter.config import INIT_STD, SLIDING_ATTENTION, DrafterConfig

CONTEXT_SCALE = "context_scale"  # --context-scale rms: the buffer's name in a checkpoint (never in an export)


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



class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig, kernel_options: dict | None = None):
        super().__init__()
        self.kernel_options = kernel_options  # flex_attention's tile sizes (attention.attend); None = torch's
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
        out = attention.attend(q, k, v, mask, self.head_dim**-0.5, self.kernel_options)
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
    def __init__(self, cfg: DrafterConfig, kernel_options: dict | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, kernel_options)
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
    """The DFlash drafter; dflash.drafter's registry builds it (or a family's subclass) for a config.

    `flex_kernel_options`: flex_attention's Triton tile sizes for every layer (bench/train_step.py measures
    choices); None = torch's defaults."""

    config_cls = DrafterConfig
    layer_cls = DecoderLayer  # DFlash2 swaps in its convolved layer

    def __init__(self, cfg: DrafterConfig, flex_kernel_options: dict | None = None, context_scale: bool = False):
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_features * H, H, bias=False)
        # --context-scale rms: a fixed per-input-channel factor of fc (a persistent buffer, ones until the
        # trainer sets it; fold_context_scale folds it into fc.weight for export).  Off: no buffer, no op.
        if context_scale:
            self.register_buffer(CONTEXT_SCALE, torch.ones(cfg.num_features * H))
        else:
            self.context_scale = None
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_cls(cfg, flex_kernel_options) for _ in range(cfg.num_hidden_layers))
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
        if not ctx_hidden.is_floating_point():  # fp8 bits read as numbers would train on garbage, silently
            raise ValueError(f"context features are {ctx_hidden.dtype}, not floating point: a batch of an fp8 "
                             "store holds e4m3 bits until MicroBatch.dequantised()")

    def _context(self, ctx_hidden: torch.Tensor) -> torch.Tensor:
        # Under autocast the bf16 features go straight into fc; otherwise match the weights' dtype.
        if not torch.is_autocast_enabled(ctx_hidden.device.type):
            ctx_hidden = ctx_hidden.to(self.fc.weight.dtype)
        if self.context_scale is None:
            return self.hidden_norm(self.fc(ctx_hidden))
        # fc(ctx_hidden * scale), computed on the weight ([H, L*H], smaller than the features): the same
        # product, and with the trainer's power-of-two scales the same bits in any dtype.
        return self.hidden_norm(F.linear(ctx_hidden, self.fc.weight * self.context_scale))

    def forward(self, ctx_hidden, block_embeds, ctx_positions, block_positions, mask, ctx_kv=None) -> torch.Tensor:
        """ctx_hidden [R,S,L*H], block_embeds [R,Q,H], positions [R,S] / [R,Q], mask: BlockMask or
        bool [R,1,Q,S+Q] or TiledMask (dflash.drafter.attention.mask_for), or {layer type: either} for a
        drafter with sliding layers -> hidden states [R,Q,H] after the final norm.  `ctx_kv`, the
        context's keys and values from `context_kv` (then ctx_hidden and ctx_positions are unused): for a
        caller that runs many blocks against one context, as the walk does."""
        if not block_embeds.is_cuda and torch.is_grad_enabled():
            mask = attention.for_backward(mask)
        if ctx_kv is None:
            self._check_features(ctx_hidden)
            ctx, ctx_rope = self._context(ctx_hidden), self.rotary_emb(ctx_positions)
        block_rope = self.rotary_emb(block_positions)
        h = block_embeds.to(self.norm.weight.dtype)  # residual stream in the parameters' dtype
        for i, (layer, kind) in enumerate(zip(self.layers, self.config.layer_types)):
            kv = ctx_kv[i] if ctx_kv is not None else layer.self_attn.project_kv(ctx, ctx_rope)
            h = layer(h, kv, block_rope, attention.layer_mask(mask, kind))
        return self.norm(h)

    def context_kv(self, ctx_hidden, ctx_positions) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's context keys and values [R, kvh, S, hd], as forward computes them: they depend on
        the context alone, so blocks drafted again and again against one context can share them."""
        self._check_features(ctx_hidden)
        ctx, rope = self._context(ctx_hidden), self.rotary_emb(ctx_positions)
        return [layer.self_attn.project_kv(ctx, rope) for layer in self.layers]

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

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, lm_head: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
        """The served proposals [R, L] of block positions 1..L (hidden [R, L, H] after the final norm):
        lm_head's argmax at each (the anchor tokens [R] are DFlash2's first predecessors)."""
        return drafter_logits(hidden, lm_head).argmax(-1)

    @classmethod
    def export_keys(cls, cfg: DrafterConfig) -> list[str]:
        """The exported tensor names of this family's drafter."""
        return state_dict_keys(cfg.num_hidden_layers, cfg.attention_bias)


def fold_context_scale(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` without the context_scale buffer, fc.weight multiplied by it column by column: the plain
    DFlash drafter that computes the same function (fc(x * s) = x @ (W * s[None, :]).T)."""
    if CONTEXT_SCALE not in state:
        return state
    state = dict(state)
    scale = state.pop(CONTEXT_SCALE)
    w = state["fc.weight"]
    state["fc.weight"] = (w.float() * scale.float().to(w.device)[None, :]).to(w.dtype)
    return state


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
