"""The DFlash2 drafter: DFlash plus grouped dynamic depthwise convolutions and a low-rank candidate
selector, computed as vLLM and SGLang serve a `DFlash2DraftModel` (docs/DESIGN.md §11).

    per layer:  x, c = attention_conv.prepare(input_layernorm(h))       # conv over the block, taps t
                h = h + attention_conv.finish(self_attn(x, ctx_kv), c)    # the block's K/V come from x
                x, c = mlp_conv.prepare(post_attention_layernorm(h))
                h = h + mlp_conv.finish(mlp(x), c)
    conv (side s):  y[q] = sum_t (base_kernel[s, t] + delta[q, t, group]) * x[q - t],  only where q % B >= t
    selector:   unary = softcap(output_multiplier * top-K lm_head logits)          # K = selector_top_k
                score[c] = unary[c] + <predecessor_codebook[prev] * hidden_projection(h), successor_codebook[c]>
                proposals: a greedy walk, prev = the anchor, then the candidate chosen one position earlier

The context keys/values are DFlash's (hidden_norm(fc(features)) through each layer's k/v projection, no
convolution).  Everything else (masks, RoPE, frozen embedding and lm_head) is
`dflash.drafter.dflash.model`'s.  A fresh DFlash2 drafter computes exactly what the DFlash drafter with the
same weights computes: the convolutions start as the identity (base tap 0 = 1, kernel_projection = 0) and
the successor codebook at 0.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflash.drafter.config import INIT_STD, DrafterConfig
from dflash.drafter.dflash.model import DecoderLayer, DFlashDrafter, drafter_logits, init_linears_and_norms

ARCHITECTURE = "DFlash2DraftModel"
# dflash_config fields every engine loader requires of a DFlash2 drafter (vLLM indexes them directly).
REQUIRED = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass
class DFlash2Config(DrafterConfig):
    conv_kernel_size: int = 2  # taps of each convolution, within the block (causal)
    conv_group_size: int = 16  # channels sharing one dynamic coefficient; divides hidden_size
    selector_rank: int = 256
    selector_top_k: int = 16
    output_multiplier: float = 1.0  # applied to the top-K lm_head logits, then the softcap
    final_logit_softcapping: float | None = None  # None / 0: none
    input_embedding_scale: float = 1.0  # the block's embeddings are multiplied by it

    def __post_init__(self):
        super().__post_init__()
        H, taps, gs = self.hidden_size, int(self.conv_kernel_size), int(self.conv_group_size)
        if taps < 1 or taps > self.block_size:
            raise ValueError(f"conv_kernel_size {taps} must lie in 1..block_size ({self.block_size})")
        if gs < 1 or H % gs:
            raise ValueError(f"conv_group_size {gs} must divide hidden_size {H}")
        if self.selector_rank < 1:
            raise ValueError(f"selector_rank must be at least 1, got {self.selector_rank}")
        if not 1 <= self.selector_top_k <= self.vocab_size:
            raise ValueError(f"selector_top_k {self.selector_top_k} must lie in 1..vocab_size ({self.vocab_size})")
        cap = self.final_logit_softcapping
        self.final_logit_softcapping = float(cap) if cap else None
        if self.final_logit_softcapping is not None and self.final_logit_softcapping < 0:
            raise ValueError(f"final_logit_softcapping must be positive, got {cap}")
        self.conv_kernel_size, self.conv_group_size = taps, gs

    @property
    def num_groups(self) -> int:
        return self.hidden_size // self.conv_group_size

    def to_hf_dict(self) -> dict:
        d = super().to_hf_dict()
        d["architectures"] = [ARCHITECTURE]
        dc = d["dflash_config"]
        dc.update({k: getattr(self, k) for k in REQUIRED})
        dc["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping is not None:
            dc["final_logit_softcapping"] = self.final_logit_softcapping
        if self.input_embedding_scale != 1.0:
            dc["input_embedding_scale"] = self.input_embedding_scale
        return d

    @classmethod
    def from_hf_dict(cls, d: dict) -> DFlash2Config:
        dc = d.get("dflash_config") or {}
        missing = [k for k in REQUIRED if dc.get(k) is None]
        if missing:
            raise ValueError(f"a DFlash2DraftModel config needs dflash_config.{', '.join(missing)}")
        knobs = {k: int(dc[k]) for k in REQUIRED}
        return cls.from_base(DrafterConfig.from_hf_dict(d), **knobs,
                             output_multiplier=float(dc.get("output_multiplier", 1.0)),
                             final_logit_softcapping=dc.get("final_logit_softcapping"),
                             input_embedding_scale=float(dc.get("input_embedding_scale", 1.0)))

    @classmethod
    def from_base(cls, cfg: DrafterConfig, **knobs) -> DFlash2Config:
        """`cfg`'s DFlash fields with these DFlash2 fields (None = the default)."""
        base = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(DrafterConfig)}
        return cls(**base, **{k: v for k, v in knobs.items() if v is not None})


class DFlashGroupedConv(nn.Module):
    """A grouped dynamic depthwise convolution over the positions of each block of B queries.

    One projection of the sublayer's input gives the dynamic coefficients of both sides (before and after
    the sublayer), one per tap and channel group, added to the static `base_kernel[side, tap, channel]`.
    The queries of a block sit at consecutive positions q whose block position is q % B (blocks start at
    multiples of B in a training row, and a drafting step is one block), so a tap t reads q - t only where
    q % B >= t: nothing crosses a block boundary."""

    def __init__(self, hidden: int, taps: int, group_size: int, block_size: int):
        super().__init__()
        self.taps, self.group_size, self.block_size = taps, group_size, block_size
        self.num_groups = hidden // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden))
        # Made without a random init (it is zeroed below): building a DFlash2 drafter draws from the RNG
        # what the DFlash one of the same seed draws, so both start from the same backbone.
        self.kernel_projection = nn.utils.skip_init(nn.Linear, hidden, 2 * taps * self.num_groups, bias=False,
                                                    device=self.base_kernel.device)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0  # the identity
        nn.init.zeros_(self.kernel_projection.weight)

    def _convolve(self, x: torch.Tensor, delta: torch.Tensor, side: int) -> torch.Tensor:
        R, Q, H = x.shape
        G, gs, taps = self.num_groups, self.group_size, self.taps
        blocks = x.view(R, Q, G, gs)
        coef = self.base_kernel[side].view(1, 1, taps, G, gs) + delta.unsqueeze(-1)  # [R, Q, taps, G, gs]
        out = coef[:, :, 0] * blocks
        pos = torch.arange(Q, device=x.device) % self.block_size
        for t in range(1, taps):
            shifted = F.pad(blocks[:, : Q - t], (0, 0, 0, 0, t, 0))
            out = out + coef[:, :, t] * shifted * (pos >= t).view(1, Q, 1, 1).to(shifted.dtype)
        return out.reshape(R, Q, H)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the input side's convolution of x [R, Q, H], the output side's coefficients [R, Q, taps, G])."""
        R, Q, _ = x.shape
        coef = self.kernel_projection(x).view(R, Q, 2, self.taps, self.num_groups)
        return self._convolve(x, coef[:, :, 0], 0), coef[:, :, 1]

    def finish(self, x: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
        return self._convolve(x, coef, 1)


class DFlash2DecoderLayer(DecoderLayer):
    def __init__(self, cfg: DFlash2Config, kernel_options: dict | None = None):
        super().__init__(cfg, kernel_options)
        args = (cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size, cfg.block_size)
        self.attention_conv = DFlashGroupedConv(*args)
        self.mlp_conv = DFlashGroupedConv(*args)

    def forward(self, h, ctx_kv, block_rope, mask):
        x, coef = self.attention_conv.prepare(self.input_layernorm(h))
        h = h + self.attention_conv.finish(self.self_attn(x, ctx_kv, block_rope, mask), coef)
        x, coef = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(x), coef)


class CandidateSelector(nn.Module):
    """Reranks the top-K lm_head candidates of a position with a rank-r transition from its predecessor."""

    def __init__(self, hidden: int, vocab: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.predecessor_codebook, std=INIT_STD)
        nn.init.zeros_(self.successor_codebook)  # the transition starts at 0: the unary (DFlash) ranking
        nn.init.normal_(self.hidden_projection.weight, std=INIT_STD)

    def scores(self, hidden, unary, candidate_ids, prev_ids) -> torch.Tensor:
        """hidden [N, H], unary / candidate_ids [N, K], prev_ids [N] -> scores [N, K] (fp32)."""
        ctx = self.predecessor_codebook[prev_ids].float() * self.hidden_projection(hidden).float()  # [N, r]
        succ = self.successor_codebook[candidate_ids].float()  # [N, K, r]
        return unary.float() + torch.einsum("nr,nkr->nk", ctx, succ)


class DFlash2Drafter(DFlashDrafter):
    config_cls = DFlash2Config
    layer_cls = DFlash2DecoderLayer

    def __init__(self, cfg: DFlash2Config, flex_kernel_options: dict | None = None, context_scale: bool = False):
        if not isinstance(cfg, DFlash2Config):
            raise TypeError("DFlash2Drafter needs a DFlash2Config")
        super().__init__(cfg, flex_kernel_options, context_scale)
        self.candidate_selector = CandidateSelector(cfg.hidden_size, cfg.vocab_size, cfg.selector_rank,
                                                    cfg.selector_top_k)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """DFlashDrafter.init_weights on the backbone, drawing in its order (so a seed gives DFlash's
        backbone), then the convolutions' identity and the selector's init."""
        own = [m for m in self.modules() if isinstance(m, (DFlashGroupedConv, CandidateSelector))]
        skip = {id(x) for m in own for x in m.modules()}
        init_linears_and_norms(m for m in self.modules() if id(m) not in skip)
        self.rotary_emb.reset_buffers(buffer_device)
        for m in own:
            m.reset_parameters()

    def forward(self, ctx_hidden, block_embeds, ctx_positions, block_positions, mask, ctx_kv=None) -> torch.Tensor:
        s = self.config.input_embedding_scale
        return super().forward(ctx_hidden, block_embeds * s if s != 1.0 else block_embeds, ctx_positions,
                               block_positions, mask, ctx_kv)

    def forward_step(self, new_ctx_hidden, block_embeds, ctx_positions, block_positions, cache):
        s = self.config.input_embedding_scale
        return super().forward_step(new_ctx_hidden, block_embeds * s if s != 1.0 else block_embeds,
                                    ctx_positions, block_positions, cache)

    def unary(self, logits: torch.Tensor) -> torch.Tensor:
        """The served transform of lm_head logits (monotone: it keeps the top-K set): fp32, times
        output_multiplier, then cap * tanh(x / cap) when final_logit_softcapping is set."""
        x = logits.float() * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        return torch.tanh(x / cap) * cap if cap else x

    def candidates(self, hidden: torch.Tensor, lm_head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(unary [N, K] fp32, ids [N, K]) of hidden [N, H], best first."""
        values, ids = torch.topk(drafter_logits(hidden, lm_head), self.config.selector_top_k, dim=-1)
        return self.unary(values), ids

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, lm_head: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
        """The served proposals [R, L] of block positions 1..L (hidden [R, L, H] after the final norm): the
        greedy walk over the candidates, its first predecessor the anchor token [R]."""
        R, L, H = hidden.shape
        unary, ids = self.candidates(hidden.reshape(R * L, H), lm_head)
        unary, ids = unary.view(R, L, -1), ids.view(R, L, -1)
        prev, out = anchor_ids.reshape(R), []
        for k in range(L):
            s = self.candidate_selector.scores(hidden[:, k], unary[:, k], ids[:, k], prev)
            prev = ids[:, k].gather(1, s.argmax(-1, keepdim=True))[:, 0]
            out.append(prev)
        return torch.stack(out, 1)

    @classmethod
    def export_keys(cls, cfg: DFlash2Config) -> list[str]:
        """DFlash's tensor names, the convolutions' and the candidate selector's."""
        keys = super().export_keys(cfg)
        for i in range(cfg.num_hidden_layers):
            for conv in ("attention_conv", "mlp_conv"):
                keys += [f"layers.{i}.{conv}.base_kernel", f"layers.{i}.{conv}.kernel_projection.weight"]
        return keys + [f"candidate_selector.{n}" for n in
                       ("predecessor_codebook", "successor_codebook", "hidden_projection.weight")]

