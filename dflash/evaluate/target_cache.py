"""The target's cache during speculative decoding, and its exact rollback after a partly rejected block.

A verified block of B tokens enters every layer's cache; when only `kept` of them are accepted, each
layer must be put back to "the prefix plus `kept` tokens" exactly, or the next step reads a state no
target-only greedy decoding would have and the output is no longer lossless.

* Full attention (`DynamicLayer`): `crop` drops the rejected keys and values.
* Sliding-window attention (`DynamicSlidingWindowLayer`, gpt-oss): once the window is full it forgets
  old keys at every update, so it records its past (`activate_past_recording`, transformers' own
  mechanism for this) and `crop` then restores the window as it was before the rejected tokens.
* Linear attention (`LinearAttentionLayer`: the gated-delta-net layers of Qwen3.5 / Qwen3.6 and
  Qwen3-Next): a recurrent state and a convolution state summarise the whole prefix and cannot be
  "un-applied".  transformers before 5.25 can record the conv states' past but not the recurrent state's
  (`is_croppable` is False for them), and 5.25's recording needs the model to keep every intermediate
  recurrent state of a forward, so on every version before each block the states (and, from 5.25, the
  layer's own token count, which the cache's length then reads) are snapshotted; after a
  partly rejected block they are restored, every attention layer is cropped back to the block's start,
  and the target re-runs the `kept` accepted tokens from there.  The re-run costs one short forward per
  partly rejected block, only on hybrid targets; a fully accepted block needs nothing.

Any other cache layer (quantised, static, sliding hybrid...) is refused with a TargetError before
decoding starts rather than risking a silently wrong rollback.
"""

from __future__ import annotations

import torch

from dflash.errors import TargetError


class _Absent:
    """Stands for a cache layer class this transformers lacks (5.17 has no DummyLayer nor linear-attention
    layers): no layer is one."""


def _classes():
    from types import SimpleNamespace

    from transformers import cache_utils as cu

    names = ("DummyLayer", "LinearAttentionLayer", "LinearAttentionAndFullAttentionLayer",
             "DynamicSlidingWindowLayer", "DynamicLayer")
    return SimpleNamespace(**{n: getattr(cu, n, _Absent) for n in names})


class TargetCache:
    """A transformers `DynamicCache` for `target` plus what its rollback needs."""

    def __init__(self, target):
        from transformers import DynamicCache

        cu = _classes()
        self.cache = DynamicCache(config=target.config)
        self.name = getattr(target, "name_or_path", None) or type(target).__name__
        self.linear = []  # layers with recurrent / conv state: snapshotted before each block
        self.attention = []  # (layer, crop function) for layers holding per-token keys and values
        self._snapshot: list | None = None
        for i, layer in enumerate(self.cache.layers):
            kind = type(layer)
            if kind is cu.DummyLayer:
                continue
            if kind is cu.LinearAttentionLayer:
                self.linear.append(layer)
            elif kind is cu.LinearAttentionAndFullAttentionLayer:
                self.linear.append(layer)
                self.attention.append((layer, lambda n, la=layer: cu.DynamicLayer.crop(la, n)))
            elif kind is cu.DynamicSlidingWindowLayer:
                layer.activate_past_recording()
                self.attention.append((layer, layer.crop))
            elif kind is cu.DynamicLayer:
                self.attention.append((layer, layer.crop))
            else:
                raise self._refuse(i, kind.__name__)

    def _refuse(self, i: int, what: str) -> TargetError:
        return TargetError(
            f"target {self.name}: its cache layer {i} is a transformers {what}, which dflash cannot roll back "
            "exactly after a partly rejected block, so online speculative decoding on it could not be lossless. "
            "Online evaluation supports full and sliding-window attention and linear-attention layers "
            "(Llama, Qwen3, Qwen3-MoE, gpt-oss, Qwen3-Next, Qwen3.5/3.6); evaluate this target offline "
            "(dflash eval without --prompts) instead."
        )

    def _check_after_prefill(self) -> None:
        # Layers a model adds lazily (no config entry) would escape the checks made in __init__.
        known = {id(layer) for layer in self.linear} | {id(layer) for layer, _ in self.attention}
        cu = _classes()
        for i, layer in enumerate(self.cache.layers):
            if id(layer) not in known and type(layer) is not cu.DummyLayer:
                raise self._refuse(i, type(layer).__name__)

    def before_block(self) -> None:
        """Snapshot the linear-attention states the next forward will overwrite in place."""
        if not self.linear:
            return
        if self._snapshot is None:
            self._check_after_prefill()
        self._snapshot = [
            (
                {k: (v.clone() if v is not None else None) for k, v in layer.conv_states.items()},
                {k: (v.clone() if v is not None else None) for k, v in layer.recurrent_states.items()},
                dict(layer.has_previous_state),
                _length(layer),
            )
            for layer in self.linear
        ]

    def keep(self, start: int, block_len: int, kept: int) -> bool:
        """After a block of `block_len` tokens at `start` whose first `kept` are accepted: cut the cache to
        `start + kept` positions.  True means the linear states were put back to `start` and every layer
        now holds `start` positions: the caller must re-run the `kept` tokens through the target."""
        if kept >= block_len:
            for _layer, crop in self.attention:
                crop(0)  # sliding layers recording their past shrink back to the window
            return False
        if not self.linear:
            for _layer, crop in self.attention:
                crop(-(block_len - kept))
            return False
        if self._snapshot is None:
            raise RuntimeError("TargetCache.keep after a block without before_block")
        for layer, (conv, rec, prev, length) in zip(self.linear, self._snapshot):
            _restore(layer.conv_states, conv)
            _restore(layer.recurrent_states, rec)
            layer.has_previous_state.update(prev)
            if length is not None:
                layer.cumulative_length_linear.copy_(length)
        for _layer, crop in self.attention:
            crop(-block_len)
        return True


def _length(layer) -> torch.Tensor | None:
    """The tokens a linear-attention layer counts itself (transformers >= 5.25, where the cache's
    `get_seq_length`, hence the next forward's positions, may come from a linear layer); None before.
    Restored in place: the model may have marked it a static address."""
    n = getattr(layer, "cumulative_length_linear", None)
    return n.clone() if isinstance(n, torch.Tensor) else None


def _restore(states: dict, saved: dict) -> None:
    """Put saved tensors back, in place where the shape still matches (cudagraph-static addresses)."""
    for k, v in saved.items():
        cur = states.get(k)
        if v is not None and isinstance(cur, torch.Tensor) and cur.shape == v.shape:
            cur.copy_(v)
        else:
            states[k] = v


__all__ = ["TargetCache"]
