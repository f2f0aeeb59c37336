"""Attention over a packed row's block-sparse mask, and the one place that picks how it is computed.

Three backends compute the same sums over the same keys:
- flex_attention over a `BlockMask` (CUDA: it skips the tiles no query sees);
- SDPA per query tile over only the key tiles it sees (`TiledMask`, the CPU's eager path: SDPA's CPU
  kernel skips no masked tile, and spent over half of a CPU training step on them);
- SDPA over a dense bool mask (a compiled drafter on the CPU: its shape does not vary by batch, so
  it never recompiles; also small checks and reference computations).
`mask_for` picks the mask form (and with it the backend) for a device from the loader's metadata;
`attend` computes attention under any of the forms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash.drafter.masks import (
    FULL_ATTENTION,
    SLIDING,
    SLIDING_ATTENTION,
    TILE,
    batched,
    block_mask_to_dense,
    has_sliding,
    to_block_mask,
    to_dense_mask,
    visible,
    visible_sliding,
)


def mask_for(meta: dict[str, torch.Tensor], device: torch.device, compiled: bool = False):
    """The mask a drafter on `device` attends through, from a batch's metadata (masks.mask_metadata):
    a BlockMask on CUDA (flex_attention); on the CPU a TiledMask eager, whose tile count varies by batch,
    and the dense mask for a compiled drafter, whose shape does not (so it never recompiles)."""
    if device.type == "cuda":
        return to_block_mask(meta)  # BlockMask.from_kv_blocks: no mask_mod evaluated over every element
    return to_dense_mask(meta) if compiled else to_tiled_mask(meta)


def is_compiled(module: torch.nn.Module) -> bool:
    """Whether `module.compile()` compiled it in place (what the evals pass to mask_for as `compiled`)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def for_backward(mask):
    """`mask` as a CPU forward with gradients can use it: flex_attention has no backward on the CPU, so a
    BlockMask (or a {layer type: BlockMask} dict) becomes the dense mask SDPA applies the same way."""
    if isinstance(mask, dict):
        return {k: for_backward(v) for k, v in mask.items()}
    return mask if mask is None or isinstance(mask, (torch.Tensor, TiledMask)) else block_mask_to_dense(mask)


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


_compiled_flex = None


def _flex(q, k, v, block_mask, scale, kernel_options: dict | None):
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    kw = {"kernel_options": dict(kernel_options)} if kernel_options and q.is_cuda else {}
    # Eager flex_attention is a dense reference implementation; on GPU outside a compiled drafter use
    # a compiled kernel. Inside torch.compile of the drafter the plain function is traced directly.
    if q.is_cuda and not torch.compiler.is_compiling():
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention)
        return _compiled_flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True, **kw)
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True, **kw)


def attend(q, k, v, mask, scale: float, kernel_options: dict | None = None) -> torch.Tensor:
    """q [R,h,Q,d], k/v [R,kvh,K,d]; mask: BlockMask, TiledMask, bool [R,1,Q,K] or None (all visible).
    `kernel_options`: flex_attention's Triton tile sizes (BLOCK_M, BLOCK_N, num_warps, ... as torch names
    them) for a BlockMask on CUDA; None = torch's defaults."""
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
    return _flex(q, k, v, mask, scale, kernel_options)


@dataclass(frozen=True)
class TiledMask:
    """A packed row's mask as the key tiles each query tile sees (the CPU path's form, tiled_sdpa): `keys`
    [R, qt, n] is the key index of each gathered slot, `attn` [R*qt, 1, tile, n] which slots each query sees
    (a query that sees none sees all, as SDPA needs; `rows_on` [R*qt, 1, tile, 1] says which see any)."""

    keys: torch.Tensor
    attn: torch.Tensor
    rows_on: torch.Tensor
    tile: int = TILE

    @classmethod
    def of(cls, keys: torch.Tensor, mask: torch.Tensor, tile: int) -> TiledMask:
        rows_on = mask.any(-1, keepdim=True)
        return cls(keys, mask | ~rows_on, rows_on, tile)


def _tiles_first(ids: torch.Tensor, used: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query tile's used key tiles first (a stable sort keeps key order), cut to the widest count:
    key indices [R, qt, width*tile] and whether each slot is a used tile's."""
    width = max(int(used.sum(-1).max()), 1)
    order = torch.sort((~used).to(torch.int8), dim=-1, stable=True).indices[..., :width]
    tiles, ok = ids.gather(-1, order), used.gather(-1, order)
    keys = (tiles.unsqueeze(-1) * tile + torch.arange(tile, device=ids.device)).flatten(-2)
    return keys, ok.repeat_interleave(tile, -1)


def _tiled(meta: dict[str, torch.Tensor], sliding: bool, tile: int) -> TiledMask:
    p = SLIDING if sliding else ""
    lists = [(meta[p + "kv_indices"], meta[p + "kv_num_blocks"]), (meta[p + "full_kv_indices"], meta[p + "full_kv_num_blocks"])]
    ids = torch.cat([idx for idx, _ in lists], -1).long()
    used = torch.cat([torch.arange(idx.shape[-1], device=idx.device) < num.unsqueeze(-1) for idx, num in lists], -1)
    keys, ok = _tiles_first(ids, used, tile)
    R, qt, n = keys.shape
    kv = [meta[k].gather(-1, keys.flatten(1)).view(R, qt, 1, n) for k in ("kv_sample", "kv_pos", "kv_block")]
    names = ("q_sample", "q_anchor", "q_block") + (("q_pos", "q_window_lo") if sliding else ())
    q = [meta[k].view(R, qt, tile, 1) for k in names]
    mask = (visible_sliding if sliding else visible)(*q, *kv) & ok.view(R, qt, 1, n)
    return TiledMask.of(keys, mask.flatten(0, 1).unsqueeze(1), tile)


def to_tiled_mask(meta: dict[str, torch.Tensor], tile: int = TILE):
    """to_dense_mask's mask as a TiledMask, from the tile lists and descriptors alone (no Q x (S+Q) mask is
    built); with sliding-window tiles in `meta`, {"full_attention": ..., "sliding_attention": ...}."""
    meta = batched(meta)
    if has_sliding(meta):
        return {FULL_ATTENTION: _tiled(meta, False, tile), SLIDING_ATTENTION: _tiled(meta, True, tile)}
    return _tiled(meta, False, tile)


def tiled_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float,
               tile: int = TILE) -> torch.Tensor | None:
    """SDPA of q [R,h,Q,d] over k/v [R,kvh,K,d] under a TiledMask, or a bool mask [R,1,Q,K], over only the key
    tiles each query tile can see; None for a bool mask whose shapes are not whole tiles or which is too dense
    to gain.

    A packed row's mask is block-diagonal by sample, so a tile of queries sees a few of the row's key tiles.
    SDPA's CPU kernel skips no masked tile (it spent over half of a CPU training step on them), so each query
    tile's visible key tiles are gathered and attended densely: the same sums over the same keys. Slots that
    pad a query tile's list are masked off, so they contribute nothing."""
    if not isinstance(mask, TiledMask):
        mask = _tiled_from_dense(mask, q.shape[2], k.shape[2], tile)
        if mask is None:
            return None
    R, h, Q, d = q.shape
    qt, tile = Q // mask.tile, mask.tile
    rows = torch.arange(R, device=q.device).view(R, 1, 1)
    kg = k.transpose(1, 2)[rows, mask.keys].permute(0, 1, 3, 2, 4).flatten(0, 1)  # [R*qt, kvh, n, d]
    vg = v.transpose(1, 2)[rows, mask.keys].permute(0, 1, 3, 2, 4).flatten(0, 1)
    qg = q.view(R, h, qt, tile, d).transpose(1, 2).flatten(0, 1)  # [R*qt, h, tile, d]
    out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask.attn, scale=scale, enable_gqa=True)
    out = out.masked_fill(~mask.rows_on, 0.0)
    return out.view(R, qt, h, tile, d).transpose(1, 2).reshape(R, h, Q, d)


def _tiled_from_dense(mask: torch.Tensor, Q: int, K: int, tile: int) -> TiledMask | None:
    if Q % tile or K % tile or mask.shape[1] != 1:
        return None
    R, qt, kt = mask.shape[0], Q // tile, K // tile
    seen = mask.view(R, qt, tile, kt, tile).any(4).any(2)  # [R, qt, kt]
    width = int(seen.sum(-1).max())
    if width == 0 or 2 * width > kt:
        return None
    keys, _ = _tiles_first(torch.arange(kt, device=mask.device).expand(R, qt, kt), seen, tile)
    mg = torch.gather(mask.view(R, qt, tile, K), 3, keys.unsqueeze(2).expand(R, qt, tile, keys.shape[-1]))
    return TiledMask.of(keys, mg.flatten(0, 1).unsqueeze(1), tile)
