"""Block-sparse attention masks for packed DFlash rows, computed closed-form from ranges.

A packed row holds a context stream of `S` tokens (several samples back to back, padded) and a block
stream of `Q` query tokens (`n_blocks * B`, padded); keys are `[ctx (S), blocks (Q)]`. A query of block
`j` sees the context keys of its own sample at positions `< anchor_j` and the `B` keys of its own block,
nothing else (docs/DESIGN.md §4).

Everything flex_attention needs is derived from the sample ranges and block anchors alone, tile by tile,
so the DataLoader workers never materialise a `Q x (S+Q)` mask and never evaluate `mask_mod` over every
element the way flex_attention's own mask builder does (that builder runs compiled code, which must not
run outside the main thread, and costs a noticeable share of every step: docs/BENCHMARKS.md).  The main
process turns the metadata into a `BlockMask` with `BlockMask.from_kv_blocks`.
"""

from __future__ import annotations

import numpy as np
import torch

TILE = 128

DESCRIPTORS = ("q_sample", "q_anchor", "q_block", "kv_sample", "kv_pos", "kv_block")
BLOCK_META = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")


def _as_np(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.int64).reshape(-1)


def _check(start, length, b_sample, b_anchor, block_size, S, Q, tile) -> None:
    if S % tile or Q % tile:
        raise ValueError(f"S={S} and Q={Q} must be multiples of the tile size {tile}")
    if len(start) != len(length) or len(b_sample) != len(b_anchor):
        raise ValueError("sample_ctx_start/sample_ctx_len and block_sample/block_anchor must have equal lengths")
    if len(b_sample) * block_size > Q:
        raise ValueError(f"{len(b_sample)} blocks of {block_size} do not fit in Q={Q}")
    if len(start) and ((start < 0).any() or (length < 0).any() or (start + length > S).any()):
        raise ValueError(f"a sample's context range falls outside [0, S={S})")
    if len(b_sample):
        if (b_sample < 0).any() or (b_sample >= len(start)).any():
            raise ValueError("block_sample refers to a sample that does not exist")
        if (b_anchor < 0).any() or (b_anchor > length[b_sample]).any():
            raise ValueError("a block anchor lies outside its sample (need 0 <= anchor <= length)")


def _descriptors(start, length, b_sample, b_anchor, B, S, Q) -> dict[str, np.ndarray]:
    nb = len(b_sample)
    slots = np.arange(nb * B)
    j = slots // B

    q_sample = np.full(Q, -1, np.int32)
    q_anchor = np.full(Q, -1, np.int32)
    q_block = np.full(Q, -1, np.int32)
    q_sample[: nb * B] = b_sample[j]
    q_anchor[: nb * B] = b_anchor[j]
    q_block[: nb * B] = j

    kv_sample = np.full(S + Q, -1, np.int32)
    kv_pos = np.full(S + Q, -1, np.int32)
    kv_block = np.full(S + Q, -1, np.int32)
    # Context keys: token t of sample n sits at start_n + t with position t.
    total = int(length.sum())
    if total:
        owner = np.repeat(np.arange(len(start)), length)
        first = np.repeat(np.cumsum(length) - length, length)
        pos = np.arange(total) - first
        idx = start[owner] + pos
        kv_sample[idx] = owner
        kv_pos[idx] = pos
    # Block keys mirror the block queries; their position is anchor + offset in block.
    kv_sample[S : S + nb * B] = q_sample[: nb * B]
    kv_pos[S : S + nb * B] = b_anchor[j] + slots % B
    kv_block[S : S + nb * B] = j
    return dict(q_sample=q_sample, q_anchor=q_anchor, q_block=q_block,
                kv_sample=kv_sample, kv_pos=kv_pos, kv_block=kv_block)


def _tile_classes(start, b_sample, b_anchor, B, S, Q, tile) -> tuple[np.ndarray, np.ndarray]:
    """(any_visible, all_visible) bool [Qt, KVt], from block ranges only."""
    nb = len(b_sample)
    Qt, St = Q // tile, S // tile
    q_lo = np.arange(Qt) * tile  # block-stream slot range of each query tile
    q_hi = q_lo + tile

    # The blocks that overlap each query tile: at most ceil(tile/B) + 1 of them.
    M = -(-tile // B) + 1
    J = (q_lo // B)[:, None] + np.arange(M)[None, :]  # [Qt, M]
    valid = (J < nb) & (J * B < q_hi[:, None])
    Jc = np.minimum(J, max(nb - 1, 0))
    if nb:
        lo = np.where(valid, start[b_sample[Jc]], 0)
        hi = np.where(valid, lo + b_anchor[Jc], 0)  # visible context: [lo, hi)
    else:
        lo = hi = np.zeros_like(J)
    tile_real = q_hi <= nb * B  # no padding query in the tile

    # Context key tiles: a tile is touched if it meets any block's interval, full if it lies
    # inside every block's interval (intervals of different samples are disjoint, so mixed
    # tiles are never full).
    k_lo = (np.arange(St) * tile)[None, None, :]
    k_hi = k_lo + tile
    lo3, hi3, v3 = lo[:, :, None], hi[:, :, None], valid[:, :, None]
    ctx_any = (v3 & (lo3 < k_hi) & (hi3 > k_lo) & (hi3 > lo3)).any(1)
    ctx_all = tile_real[:, None] & (~v3 | ((lo3 <= k_lo) & (hi3 >= k_hi))).all(1)

    # Block key tiles (same slot coordinates as queries): touched if a block of the query tile
    # overlaps the key tile; full only if one block covers both tiles entirely.
    b_lo = (np.arange(Qt) * tile)[None, None, :]
    b_hi = b_lo + tile
    J3 = J[:, :, None]
    blk_any = (v3 & (J3 * B < b_hi) & ((J3 + 1) * B > b_lo)).any(1)
    j0 = J[:, 0][:, None]
    both_lo = np.minimum(q_lo[:, None], b_lo[0])
    both_hi = np.maximum(q_hi[:, None], b_hi[0])
    blk_all = (j0 < nb) & (j0 * B <= both_lo) & ((j0 + 1) * B >= both_hi)

    return np.concatenate([ctx_any, blk_any], 1), np.concatenate([ctx_all, blk_all], 1)


def _compact(sel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """from_kv_blocks layout: counts [Qt] and indices [Qt, KVt], the selected tiles first, ascending."""
    num = sel.sum(1).astype(np.int32)
    idx = np.argsort(~sel, axis=1, kind="stable").astype(np.int32)
    return num, idx


def mask_metadata(sample_ctx_start, sample_ctx_len, block_sample, block_anchor, block_size: int,
                  S: int, Q: int, tile: int = TILE) -> dict[str, torch.Tensor]:
    """Block-sparse metadata + per-token descriptors for one packed row (all int32 tensors).

    `kv_*` hold the partially visible tiles (mask_mod applied), `full_kv_*` the entirely visible ones
    (mask_mod skipped); tiles in neither are skipped entirely. Indices are padded with unused tile ids.
    """
    start, length = _as_np(sample_ctx_start), _as_np(sample_ctx_len)
    b_sample, b_anchor = _as_np(block_sample), _as_np(block_anchor)
    _check(start, length, b_sample, b_anchor, block_size, S, Q, tile)
    any_vis, all_vis = _tile_classes(start, b_sample, b_anchor, block_size, S, Q, tile)
    kv_num, kv_idx = _compact(any_vis & ~all_vis)
    full_num, full_idx = _compact(all_vis)
    out = dict(kv_num_blocks=kv_num, kv_indices=kv_idx, full_kv_num_blocks=full_num, full_kv_indices=full_idx)
    out.update(_descriptors(start, length, b_sample, b_anchor, block_size, S, Q))
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in out.items()}


def stack_metadata(metas: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack per-row metadata (same S, Q) into a batch: every tensor gains a leading R dim."""
    return {k: torch.stack([m[k] for m in metas]) for k in metas[0]}


def visible(q_sample, q_anchor, q_block, kv_sample, kv_pos, kv_block):
    """The attention rule, elementwise on broadcastable descriptor values."""
    ctx_ok = (kv_block < 0) & (kv_pos < q_anchor)
    return (q_sample >= 0) & (q_sample == kv_sample) & (ctx_ok | (kv_block == q_block))


def dense_mask(desc: dict[str, torch.Tensor]) -> torch.Tensor:
    """Reference bool mask [..., Q, S+Q] straight from the rule (tests and the SDPA path)."""
    q = [desc[k].unsqueeze(-1) for k in ("q_sample", "q_anchor", "q_block")]
    kv = [desc[k].unsqueeze(-2) for k in ("kv_sample", "kv_pos", "kv_block")]
    return visible(*q, *kv)


def make_mask_mod(desc: dict[str, torch.Tensor]):
    """flex_attention mask_mod over batched descriptors ([R, Q] and [R, S+Q])."""
    qs, qa, qb = desc["q_sample"], desc["q_anchor"], desc["q_block"]
    ks, kp, kb = desc["kv_sample"], desc["kv_pos"], desc["kv_block"]

    def mask_mod(b, h, q_idx, kv_idx):
        return visible(qs[b, q_idx], qa[b, q_idx], qb[b, q_idx], ks[b, kv_idx], kp[b, kv_idx], kb[b, kv_idx])

    return mask_mod


def _batched(meta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if meta["kv_num_blocks"].dim() == 1:  # a single row
        return {k: v.unsqueeze(0) for k, v in meta.items()}
    return meta


def to_block_mask(meta: dict[str, torch.Tensor], tile: int = TILE):
    """BlockMask for R stacked rows (or one row), via BlockMask.from_kv_blocks; heads broadcast."""
    from torch.nn.attention.flex_attention import BlockMask

    meta = _batched(meta)
    Q, SQ = meta["q_sample"].shape[-1], meta["kv_sample"].shape[-1]
    return BlockMask.from_kv_blocks(
        meta["kv_num_blocks"].unsqueeze(1),
        meta["kv_indices"].unsqueeze(1),
        meta["full_kv_num_blocks"].unsqueeze(1),
        meta["full_kv_indices"].unsqueeze(1),
        BLOCK_SIZE=tile,
        mask_mod=make_mask_mod(meta),
        seq_lengths=(Q, SQ),
    )


def _tile_map(num: torch.Tensor, idx: torch.Tensor, n_kv_tiles: int) -> torch.Tensor:
    """[..., Qt] counts + [..., Qt, W] indices -> bool [..., Qt, n_kv_tiles]."""
    used = torch.arange(idx.shape[-1], device=idx.device) < num.unsqueeze(-1)
    out = torch.zeros(*idx.shape[:-1], n_kv_tiles + 1, dtype=torch.bool, device=idx.device)
    out.scatter_(-1, torch.where(used, idx.long(), n_kv_tiles), True)  # unused slots land in a spare column
    return out[..., :n_kv_tiles]


def block_mask_to_dense(bm) -> torch.Tensor:
    """Bool [R, H, Q, KV] exactly as flex_attention applies a BlockMask: full tiles on, partial tiles
    through mask_mod, other tiles off. Eager and dense: for CPU training and checks on small inputs."""
    from torch.nn.attention.flex_attention import create_mask

    Q, KV = bm.seq_lengths
    tq, tk = bm.BLOCK_SIZE
    R, Hm = bm.kv_num_blocks.shape[:2]
    n_kv_tiles = -(-KV // tk)
    partial = _tile_map(bm.kv_num_blocks, bm.kv_indices, n_kv_tiles)
    full = (_tile_map(bm.full_kv_num_blocks, bm.full_kv_indices, n_kv_tiles)
            if bm.full_kv_num_blocks is not None else torch.zeros_like(partial))

    def expand(t):
        return t.repeat_interleave(tq, -2).repeat_interleave(tk, -1)[..., :Q, :KV]

    mod = create_mask(bm.mask_mod, R, Hm, Q, KV, device=bm.kv_indices.device)
    return (expand(partial) & mod) | expand(full)


def to_dense_mask(meta: dict[str, torch.Tensor]) -> torch.Tensor:
    """Bool [R, 1, Q, S+Q] for the model's SDPA path (small inputs, CPU, debugging)."""
    return dense_mask(_batched(meta)).unsqueeze(1)
