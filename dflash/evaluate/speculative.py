"""Greedy speculative decoding with a DFlash drafter, and the target-only greedy loop it must match.

One step (as in z-lab's DFlash inference):

1. The drafter sees the context features of every position before the anchor (the output of the
   target layers `target_layer_ids`, captured while the target verified earlier tokens) and a block
   `[anchor token, MASK x (B-1)]` at positions `start .. start+B-1`; it proposes B-1 tokens in one
   non-causal pass.  Its KV cache then drops the block's keys (`crop(start)`) and keeps the context's,
   so every context position is projected exactly once.
2. The target runs the block through its KV cache.  Its greedy token after block prefix `i` is
   `posterior[i]`; the longest prefix of proposals equal to the posteriors is accepted, and
   `posterior[acc]` is the bonus token and the next anchor.  The target cache is cut back to the
   accepted tokens (dflash/evaluate/target_cache.py: cropped, or on linear-attention layers restored
   from a snapshot and the accepted tokens re-run), and their hidden states become the drafter's new context.

Both loops emit the prefill's greedy token first, then stop after an eos token (kept) or at
`max_new_tokens`, so with exact arithmetic their outputs are identical token for token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# propose(start, proposals [B-1]) -> proposals [B-1]: a test hook that may replace the drafter's guesses.
ProposeHook = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass
class Generation:
    tokens: list[int]  # generated token ids, prompt excluded
    seconds: float | None  # wall time of the whole generation, prefill included; None: decoded in a batch
    acceptance: list[int] = field(default_factory=list)  # tokens produced per target forward (speculative)
    verified: list[int] = field(default_factory=list)  # drafts the target verified per step (speculative)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class LayerCapture:
    """Forward hooks keeping the *output* of the chosen decoder layers from the latest target call.

    Same convention as precompute (dflash.target_model.capture.Capture): the output of layer i is `hidden_states[i+1]`
    in transformers terms, and for the last layer that is the state after the final norm.
    """

    def __init__(self, target, layer_ids: list[int]):
        from dflash.target_model.capture import check_layers, decoder_layers

        layers = decoder_layers(target)
        self.layer_ids = check_layers(list(layer_ids), len(layers), getattr(target, "name_or_path", "?"))
        final_norm = getattr(target.get_decoder(), "norm", None)
        self._out: dict[int, torch.Tensor] = {}
        self._handles = [
            layers[i].register_forward_hook(self._hook(i, final_norm if i == len(layers) - 1 else None))
            for i in self.layer_ids
        ]

    def _hook(self, i: int, norm):
        def hook(_module, _args, output):
            h = output[0] if isinstance(output, (tuple, list)) else output
            self._out[i] = norm(h) if norm is not None else h

        return hook

    def features(self) -> torch.Tensor:
        """[batch, seq, n_layers * H]: the captured layers concatenated in `layer_ids` order."""
        return torch.cat([self._out[i] for i in self.layer_ids], dim=-1)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _cache_kw(target) -> str:
    """transformers 5.x renamed forward's `past_key_values` to `cache`; use whichever this one takes."""
    import inspect

    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


def crop_cache(cache, length: int) -> None:
    """Keep the first `length` positions of a transformers cache (negative crop: the form 4.x and 5.x share)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


# Prompt tokens one target forward of the eval's prefill takes.  In fp32 on a GPU the attention of a grouped-
# query target runs on the math kernel, whose scores are heads x queries x keys: a whole long prompt at
# once would hold heads x prompt^2 of them (docs/DESIGN.md §6).
PREFILL_CHUNK = 2048


def prefill(target, ids: torch.Tensor, cache_kw: dict, *, mask: torch.Tensor | None = None,
            positions: torch.Tensor | None = None, capture: LayerCapture | None = None,
            chunk: int | None = None):
    """Run prompts `ids` [rows, width] into the target's cache, `chunk` tokens a forward, each piece
    attending to the cache of the pieces before it.  Returns the last forward's output (the logits of
    the last position) and, with `capture`, the captured features of every prompt position.  Every
    decode of a prompt goes through here, the target-only reference and the speculative one alike, so
    both see the same pieces and the same arithmetic.  `mask` (left padding) and `positions` are
    [rows, width]."""
    chunk = chunk or PREFILL_CHUNK
    width = ids.shape[1]
    features = []
    for s in range(0, width, chunk):
        e = min(s + chunk, width)
        kw = dict(cache_kw)
        if mask is not None:
            kw["attention_mask"] = mask[:, :e]
        if positions is not None:
            kw["position_ids"] = positions[:, s:e]
        out = target(input_ids=ids[:, s:e], logits_to_keep=1, **kw)
        if capture is not None:
            features.append(capture.features())
    return out, (torch.cat(features, dim=1) if capture is not None else None)


def _finish(tokens: list[int], max_new_tokens: int, eos_ids: set[int]) -> tuple[list[int], bool]:
    """Cut `tokens` after the first eos or at max_new_tokens; say whether generation is over."""
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in eos_ids:
            return tokens[: i + 1], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


@torch.inference_mode()
def greedy_generate(target, prompt_ids: torch.Tensor, max_new_tokens: int, eos_ids: set[int]) -> Generation:
    """Target-only greedy decoding with a KV cache, one token per forward: the reference and baseline."""
    from transformers import DynamicCache

    device = prompt_ids.device
    _sync(device)
    t0 = time.perf_counter()
    cache = DynamicCache(config=target.config)
    kw = _cache_kw(target)
    out, _ = prefill(target, prompt_ids.view(1, -1), {kw: cache, "use_cache": True})
    tokens: list[int] = []
    while True:
        tok = out.logits[0, -1].argmax()
        tokens.append(int(tok))
        tokens, done = _finish(tokens, max_new_tokens, eos_ids)
        if done:
            break
        out = target(input_ids=tok.view(1, 1), **{kw: cache}, use_cache=True)
    _sync(device)
    return Generation(tokens=tokens, seconds=time.perf_counter() - t0)


@torch.inference_mode()
def _draft(drafter, hidden: torch.Tensor, head_weight: torch.Tensor, anchor: torch.Tensor,
           confidence_threshold: float | None) -> tuple[torch.Tensor, int]:
    """The block's B-1 proposals, as the drafter's family serves them (lm_head's argmax or its own walk),
    and how many of them the target verifies: all, or as many as a confidence head keeps."""
    from dflash.drafter import family_of

    return family_of(drafter.config).draft(drafter, hidden, head_weight, anchor, confidence_threshold)


def speculative_generate(
    target,
    drafter,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    eos_ids: set[int],
    propose: ProposeHook | None = None,
    confidence_threshold: float | None = None,
) -> Generation:
    """Greedy speculative decoding: the drafter proposes B-1 tokens per step, the target keeps a prefix.

    `drafter` is a `DFlashDrafter` on the target's device and dtype; it uses the target's own input
    embedding and lm_head (docs/DESIGN.md §2).  With `confidence_threshold` a drafter with a confidence
    head lets it pick how many of its drafts the target verifies (DrafterFamily.draft); the rest are
    dropped unverified (docs/DESIGN.md §12).
    """
    from dflash.evaluate.target_cache import TargetCache

    cfg = drafter.config
    B, mask_id = cfg.block_size, cfg.mask_token_id
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    device = prompt_ids.device
    prompt_ids = prompt_ids.view(1, -1)
    P = prompt_ids.shape[1]
    offsets = torch.arange(B, device=device)

    _sync(device)
    t0 = time.perf_counter()
    with LayerCapture(target, cfg.target_layer_ids) as capture:
        target_cache = TargetCache(target)  # crop, or snapshot + re-run for linear attention (target_cache.py)
        kw = _cache_kw(target)
        out, context = prefill(target, prompt_ids, {kw: target_cache.cache, "use_cache": True}, capture=capture)
        anchor = out.logits[0, -1].argmax()  # `context`: features of positions [drafted, start) not yet drafted from
        draft_cache = drafter.new_cache()
        tokens, done = _finish([int(anchor)], max_new_tokens, eos_ids)
        acceptance: list[int] = []
        verified: list[int] = []
        start, drafted = P, 0  # `start`: position of the anchor; `drafted`: context length in the draft cache
        while not done:
            block = torch.full((1, B), mask_id, dtype=torch.long, device=device)
            block[0, 0] = anchor
            hidden = drafter.forward_step(
                context,
                embed(block),
                ctx_positions=torch.arange(drafted, start, device=device).view(1, -1),
                block_positions=(start + offsets).view(1, -1),
                cache=draft_cache,
            )
            draft_cache.crop(start)
            drafted = start
            proposals, n_verify = _draft(drafter, hidden[:, 1:].to(head.weight.dtype), head.weight, anchor,
                                         confidence_threshold)
            if propose is not None:
                proposals = propose(start, proposals).to(device=device, dtype=torch.long)
            block[0, 1:] = proposals
            block = block[:, : 1 + n_verify]
            verified.append(n_verify)

            target_cache.before_block()
            out = target(input_ids=block, **{kw: target_cache.cache}, use_cache=True)
            posterior = out.logits[0].argmax(-1)  # posterior[i]: the target's token after block[: i + 1]
            acc = int((block[0, 1:] == posterior[:-1]).long().cumprod(0).sum())
            acceptance.append(acc + 1)
            anchor = posterior[acc]
            new = block[0, 1 : acc + 1].tolist() + [int(anchor)]
            tokens, done = _finish(tokens + new, max_new_tokens, eos_ids)
            context = capture.features()[:, : acc + 1]
            if target_cache.keep(start, block.shape[1], acc + 1) and not done:
                # linear-attention states were restored to `start`: advance every layer by the accepted tokens
                target(input_ids=block[:, : acc + 1], **{kw: target_cache.cache}, use_cache=True, logits_to_keep=1)
                context = capture.features()
            start += acc + 1
    _sync(device)
    return Generation(tokens=tokens, seconds=time.perf_counter() - t0, acceptance=acceptance, verified=verified)


__all__ = ["Generation", "LayerCapture", "greedy_generate", "prefill", "speculative_generate"]
