"""The DSpark drafter: the DFlash backbone plus a low-rank Markov head and a confidence head, computed as
vLLM serves a `Qwen3DSparkModel` (docs/DESIGN.md §12).

    logits_k  = lm_head(norm(h_k)) + markov_w2(markov_w1[prev_k])        # prev_k: the token before k
    conf_k    = proj([norm(h_k), markov_w1[prev_k]])                     # a logit: P(position k accepted)
    proposals = a greedy walk: prev_1 = the anchor, prev_{k+1} = the token chosen at k

Block layout: DFlash's (`[anchor, MASK x (B-1)]`, positions 1..B-1 propose), which vLLM serves for a
DSpark checkpoint that sets `dspark_bonus_anchor` (`num_speculative_tokens = block_size - 1`).  The
backbone is `dflash.drafter.dflash.model`'s unchanged; a DSpark drafter built from a seed draws the
backbone the DFlash drafter of that seed draws.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from dflash.drafter.config import INIT_STD, DrafterConfig
from dflash.drafter.dflash.model import DFlashDrafter, drafter_logits, init_linears_and_norms

ARCHITECTURE = "Qwen3DSparkModel"
KNOBS = ("markov_rank", "enable_confidence_head", "confidence_head_with_markov")
# config.json fields this family writes (top level, where vLLM's Qwen3DSparkModel reads them, and in
# dflash_config, where SpecForge's DSparkDraftModel configs keep them); from_hf_dict reads either.
_OWN = (*KNOBS, "markov_head_type", "dspark_bonus_anchor", "projector_type")


@dataclass
class DSparkConfig(DrafterConfig):
    markov_rank: int = 256  # rank of the Markov head's transition bias (vLLM always builds the head)
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True  # the confidence head also reads markov_w1[prev]

    def __post_init__(self):
        super().__post_init__()
        self.markov_rank = int(self.markov_rank)
        if self.markov_rank < 1:
            raise ValueError(f"markov_rank must be at least 1 (vLLM's DSpark model always has the Markov head), "
                             f"got {self.markov_rank}")
        self.enable_confidence_head = bool(self.enable_confidence_head)
        self.confidence_head_with_markov = bool(self.confidence_head_with_markov)

    @property
    def confidence_width(self) -> int:
        return self.hidden_size + (self.markov_rank if self.confidence_head_with_markov else 0)

    def to_hf_dict(self) -> dict:
        d = super().to_hf_dict()
        own = {"markov_rank": self.markov_rank, "markov_head_type": "vanilla",
               "enable_confidence_head": self.enable_confidence_head,
               "confidence_head_with_markov": self.confidence_head_with_markov}
        d["architectures"] = [ARCHITECTURE]
        d.update(own, dspark_bonus_anchor=True)  # the anchor is the bonus token: DFlash's 1 + N block
        d["dflash_config"].update(own, projector_type="dspark")
        return d

    @classmethod
    def from_hf_dict(cls, d: dict) -> DSparkConfig:
        dc = d.get("dflash_config") or {}

        def get(k, default):
            return d[k] if d.get(k) is not None else dc.get(k, default)

        base = DrafterConfig.from_hf_dict(d)
        base.extra = {k: v for k, v in base.extra.items() if k not in _OWN}
        if get("markov_head_type", "vanilla") != "vanilla":
            raise ValueError(f"markov_head_type {get('markov_head_type', '')!r}: only 'vanilla' is served by vLLM")
        return cls.from_base(base, markov_rank=int(get("markov_rank", 256)),
                             enable_confidence_head=bool(get("enable_confidence_head", True)),
                             confidence_head_with_markov=bool(get("confidence_head_with_markov", True)))

    @classmethod
    def from_base(cls, cfg: DrafterConfig, **knobs) -> DSparkConfig:
        """`cfg`'s DFlash fields with these DSpark fields (None = the default)."""
        base = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(DrafterConfig)}
        return cls(**base, **{k: v for k, v in knobs.items() if v is not None and k in KNOBS})


class MarkovHead(nn.Module):
    """bias(prev) = markov_w2(markov_w1[prev]): a rank-r bigram logit bias (vLLM's DSparkMarkovHead names)."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        # DeepSpec's DSpark initialises both as transformers' post_init does: N(0, initializer_range).
        nn.init.normal_(self.markov_w1.weight, std=INIT_STD)
        nn.init.normal_(self.markov_w2.weight, std=INIT_STD)

    def embed(self, prev_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev_ids)

    def bias(self, embedded: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(embedded)


class ConfidenceHead(nn.Module):
    """A logit per position: the predicted probability that the target accepts the position's token."""

    def __init__(self, width: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(width, 1, bias=True)  # vLLM loads proj.weight and proj.bias

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.proj.weight, std=INIT_STD)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        x = torch.cat([hidden, embedded.to(hidden.dtype)], -1) if self.with_markov else hidden
        return self.proj(x.to(self.proj.weight.dtype)).float().squeeze(-1)  # bf16 features, fp32 weights on GPU


class DSparkDrafter(DFlashDrafter):
    config_cls = DSparkConfig

    def __init__(self, cfg: DSparkConfig, flex_kernel_options: dict | None = None, context_scale: bool = False):
        if not isinstance(cfg, DSparkConfig):
            raise TypeError("DSparkDrafter needs a DSparkConfig")
        super().__init__(cfg, flex_kernel_options, context_scale)
        self.markov_head = MarkovHead(cfg.vocab_size, cfg.markov_rank)
        self.confidence_head = (ConfidenceHead(cfg.confidence_width, cfg.confidence_head_with_markov)
                                if cfg.enable_confidence_head else None)
        self.reset_heads()

    def reset_heads(self) -> None:
        self.markov_head.reset_parameters()
        if self.confidence_head is not None:
            self.confidence_head.reset_parameters()

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """DFlashDrafter.init_weights on the backbone (the same draws), then the heads' init."""
        heads = [m for m in (getattr(self, "markov_head", None), getattr(self, "confidence_head", None)) if m]
        skip = {id(x) for m in heads for x in m.modules()}
        init_linears_and_norms(m for m in self.modules() if id(m) not in skip)
        self.rotary_emb.reset_buffers(buffer_device)
        for m in heads:
            m.reset_parameters()

    def head_logits(self, hidden: torch.Tensor, lm_head: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """lm_head logits plus the Markov bias of the predecessors: hidden [..., H], prev_ids [...] -> [..., V]."""
        e = self.markov_head.embed(prev_ids)
        return drafter_logits(hidden, lm_head) + self.markov_head.bias(e).to(hidden.dtype)

    def confidence(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor | None:
        """Confidence logits [...] (fp32) of hidden [..., H] after predecessors prev_ids [...]; None without the head."""
        if self.confidence_head is None:
            return None
        return self.confidence_head(hidden, self.markov_head.embed(prev_ids))

    @torch.no_grad()
    def propose_with_confidence(self, hidden, lm_head, anchor_ids) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(proposals [R, L], confidence logits [R, L] or None) of block positions 1..L, hidden [R, L, H] after
        the final norm: vLLM's sequential walk (DSparkSpeculator._sample_sequential): at each position the
        Markov embedding of the previous token (the anchor [R] first) gives the confidence and the bias added
        to the lm_head logits, whose argmax is the proposal and the next predecessor."""
        prev, out, conf = anchor_ids.reshape(-1), [], []
        for k in range(hidden.shape[1]):
            h = hidden[:, k]
            c = self.confidence(h, prev)
            if c is not None:
                conf.append(c)
            prev = self.head_logits(h, lm_head, prev).argmax(-1)
            out.append(prev)
        return torch.stack(out, 1), (torch.stack(conf, 1) if conf else None)

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, lm_head: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
        return self.propose_with_confidence(hidden, lm_head, anchor_ids)[0]

    @classmethod
    def export_keys(cls, cfg: DSparkConfig) -> list[str]:
        """DFlash's tensor names and the heads' (vLLM's Qwen3DSparkModel: `markov_head.*`, `confidence_head.*`)."""
        keys = super().export_keys(cfg) + ["markov_head.markov_w1.weight", "markov_head.markov_w2.weight"]
        if cfg.enable_confidence_head:
            keys += ["confidence_head.proj.weight", "confidence_head.proj.bias"]
        return keys


def verify_capacity(confidence_logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """Drafts to verify per row [R] from confidence logits [R, L], as vLLM's DSpark capacity rule with
    `dspark_confidence_threshold` t > 0 (capacity.py): the positions whose survival probability, the running
    product of sigmoid(confidence), is at least t."""
    survival = torch.sigmoid(confidence_logits.float()).cumprod(-1)
    return (survival >= threshold).sum(-1)


__all__ = ["ARCHITECTURE", "KNOBS", "ConfidenceHead", "DSparkConfig", "DSparkDrafter", "MarkovHead", "verify_capacity"]
