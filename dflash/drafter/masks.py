"""Block-sparse attention masks for packed DFlash rows, computed closed-form from ranges.

A packed row holds a context stream of `S` tokens (several samples back to back, padded) and a block
stream of `Q` query tokens (`n_blocks * B`, padded); keys are `[ctx (S), blocks (Q)]`. A query of block
`j` sees the context keys of its own sample at positions `< anchor_j` and the `B` keys of its own block,
nothing else (docs/DESIGN.md §4).  On a sliding-window layer (window `W`, as vLLM and SGLang serve
DFlash drafters) a query at absolute position `p` further keeps only the keys at positions
`p - W < j <= p` of those: causal inside its block, at most `W` keys back.

Everything flex_attention needs is derived from the sample ranges and block anchors alone, tile by tile,
so the DataLoader workers never materialise a `Q x (S+Q)` mask and never evaluate `mask_mod` over every
element the way flex_attention's own mask builder does (that builder runs compiled code, which must not
run outside the main thread, and would cost time in every step).  The main
process turns the metadata into a `BlockMask` with `BlockMask.from_kv_blocks`.
"""

from __future__ import annotations

import numpy as np
import torch

TILE = 128

DESCRIPTORS = ("q_sample", "q_anchor", "q_block", "q_pos", "kv_sample", "kv_pos", "kv_block")
BLOCK_META = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
# A sliding-window layer's tiles: the same layout under this prefix, plus the descriptor q_window_lo
# (the smallest key position a query sees).
SLIDING = "swa_"
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


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


def _descriptors(start, length, b_sample, b_anchor, B, S, Q, window=None) -> dict[str, np.ndarray]:
    nb = len(b_sample)
    slots = np.arange(nb * B)
    j = slots // B

    q_sample = np.full(Q, -1, np.int32)
    q_anchor = np.full(Q, -1, np.int32)
    q_block = np.full(Q, -1, np.int32)
    q_pos = np.full(Q, -1, np.int32)
    q_sample[: nb * B] = b_sample[j]
    q_anchor[: nb * B] = b_anchor[j]
    q_block[: nb * B] = j
    q_pos[: nb * B] = b_anchor[j] + slots % B

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
    out = dict(q_sample=q_sample, q_anchor=q_anchor, q_block=q_block, q_pos=q_pos,
               kv_sample=kv_sample, kv_pos=kv_pos, kv_block=kv_block)
    if window is not None:  # smallest visible key position on a sliding layer: p - W + 1
        q_window_lo = np.full(Q, -1, np.int32)
        q_window_lo[: nb * B] = q_pos[: nb * B] - window + 1
        out["q_window_lo"] = q_window_lo
    return out


def _tile_classes(start, b_sample, b_anchor, B, S, Q, tile, window=None) -> tuple[np.ndarray, np.ndarray]:
    """(any_visible, all_visible) bool [Qt, KVt], from block ranges only.

    For each query tile and each block overlapping it, the block's queries there are offsets
    `klo..khi`; each sees an interval of context keys and one of its own block's keys.  A key tile is
    touched if it meets the union of those intervals over the tile's queries, and full if it lies inside
    their intersection for every block of the tile (intervals of different samples or blocks are
    disjoint, so a tile with several blocks is never full).  Without a window every query of a block
    sees the same intervals: context `[start, start + anchor)` and the whole block.  With window `W`
    offset `k` sees context positions `>= anchor + k - W + 1` and block offsets `k - W + 1 .. k`.
    """
    nb = len(b_sample)
    Qt, St = Q // tile, S // tile
    q_lo = np.arange(Qt) * tile  # block-stream slot range of each query tile
    q_hi = q_lo + tile

    # The blocks that overlap each query tile: at most ceil(tile/B) + 1 of them.
    M = -(-tile // B) + 1
    J = (q_lo // B)[:, None] + np.arange(M)[None, :]  # [Qt, M]
    valid = (J < nb) & (J * B < q_hi[:, None])
    Jc = np.minimum(J, max(nb - 1, 0))
    klo = np.maximum(q_lo[:, None] - J * B, 0)  # offsets of block J inside the query tile: klo..khi
    khi = np.minimum(q_hi[:, None] - J * B, B) - 1
    if nb:
        s0 = np.where(valid, start[b_sample[Jc]], 0)
        a = np.where(valid, b_anchor[Jc], 0)
    else:
        s0 = a = np.zeros_like(J)
    hi = s0 + a  # visible context: [lo, hi)
    if window is None:
        lo_any = lo_all = s0
        blo_any = blo_all = J * B  # visible block slots: [blo, bhi]
        bhi_any = bhi_all = J * B + B - 1
    else:
        lo_any = s0 + np.maximum(a + klo - window + 1, 0)
        lo_all = s0 + np.maximum(a + khi - window + 1, 0)
        blo_any, bhi_any = J * B + np.maximum(klo - window + 1, 0), J * B + khi
        blo_all, bhi_all = J * B + np.maximum(khi - window + 1, 0), J * B + klo
    tile_real = q_hi <= nb * B  # no padding query in the tile

    def classes(lo_a, hi_a, lo_f, hi_f, k_lo, k_hi):
        """Half-open key intervals [lo, hi) per (query tile, block) against key tiles [k_lo, k_hi)."""
        v3 = valid[:, :, None]
        lo_a, hi_a, lo_f, hi_f = (x[:, :, None] for x in (lo_a, hi_a, lo_f, hi_f))
        touched = (v3 & (lo_a < k_hi) & (hi_a > k_lo) & (hi_a > lo_a)).any(1)
        full = tile_real[:, None] & (~v3 | ((lo_f <= k_lo) & (hi_f >= k_hi))).all(1)
        return touched, full

    k_lo = (np.arange(St) * tile)[None, None, :]
    ctx_any, ctx_all = classes(lo_any, hi, lo_all, hi, k_lo, k_lo + tile)
    b_lo = (np.arange(Qt) * tile)[None, None, :]  # block key tiles, in the same slot coordinates as queries
    blk_any, blk_all = classes(blo_any, bhi_any + 1, blo_all, bhi_all + 1, b_lo, b_lo + tile)
    return np.concatenate([ctx_any, blk_any], 1), np.concatenate([ctx_all, blk_all], 1)


def _compact(sel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """from_kv_blocks layout: counts [Qt] and indices [Qt, KVt], the selected tiles first, ascending."""
    num = sel.sum(1).astype(np.int32)
    idx = np.argsort(~sel, axis=1, kind="stable").astype(np.int32)
    return num, idx


def _block_meta(any_vis: np.ndarray, all_vis: np.ndarray, prefix: str = "") -> dict[str, np.ndarray]:
    kv_num, kv_idx = _compact(any_vis & ~all_vis)
    full_num, full_idx = _compact(all_vis)
    return {prefix + "kv_num_blocks": kv_num, prefix + "kv_indices": kv_idx,
            prefix + "full_kv_num_blocks": full_num, prefix + "full_kv_indices": full_idx}


def mask_metadata(sample_ctx_start, sample_ctx_len, block_sample, block_anchor, block_size: int,
                  S: int, Q: int, tile: int = TILE, sliding_window: int | None = None) -> dict[str, torch.Tensor]:
    """Block-sparse metadata + per-token descriptors for one packed row (all int32 tensors).

    `kv_*` hold the partially visible tiles (mask_mod applied), `full_kv_*` the entirely visible ones
    (mask_mod skipped); tiles in neither are skipped entirely. Indices are padded with unused tile ids.
    With `sliding_window` W, the tiles of a sliding-window layer follow under the `swa_` prefix (tiles
    wholly outside every query's window skipped) with the descriptor `q_window_lo`.
    """
    start, length = _as_np(sample_ctx_start), _as_np(sample_ctx_len)
    b_sample, b_anchor = _as_np(block_sample), _as_np(block_anchor)
    _check(start, length, b_sample, b_anchor, block_size, S, Q, tile)
    if sliding_window is not None and int(sliding_window) < 1:
        raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
    W = None if sliding_window is None else int(sliding_window)
    out = _block_meta(*_tile_classes(start, b_sample, b_anchor, block_size, S, Q, tile))
    if W is not None:
        out.update(_block_meta(*_tile_classes(start, b_sample, b_anchor, block_size, S, Q, tile, W), SLIDING))
    out.update(_descriptors(start, length, b_sample, b_anchor, block_size, S, Q, W))
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in out.items()}


def stack_metadata(metas: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack per-row metadata (same S, Q) into a batch: every tensor gains a leading R dim."""
    return {k: torch.stack([m[k] for m in metas]) for k in metas[0]}


def visible(q_sample, q_anchor, q_block, kv_sample, kv_pos, kv_block):
    """The attention rule of a full layer, elementwise on broadcastable descriptor values."""
    ctx_ok = (kv_block < 0) & (kv_pos < q_anchor)
    return (q_sample >= 0) & (q_sample == kv_sample) & (ctx_ok | (kv_block == q_block))


def visible_sliding(q_sample, q_anchor, q_block, q_pos, q_window_lo, kv_sample, kv_pos, kv_block):
    """A sliding-window layer's rule: the full rule, then only keys at positions q_window_lo..q_pos."""
    return (visible(q_sample, q_anchor, q_block, kv_sample, kv_pos, kv_block)
            & (kv_pos >= q_window_lo) & (kv_pos <= q_pos))


def has_sliding(meta: dict) -> bool:
    return SLIDING + "kv_num_blocks" in meta


def dense_mask(desc: dict[str, torch.Tensor], sliding: bool = False) -> torch.Tensor:
    """Reference bool mask [..., Q, S+Q] straight from the rule (tests and the SDPA path)."""
    kv = [desc[k].unsqueeze(-2) for k in ("kv_sample", "kv_pos", "kv_block")]
    if sliding:
        q = [desc[k].unsqueeze(-1) for k in ("q_sample", "q_anchor", "q_block", "q_pos", "q_window_lo")]
        return visible_sliding(*q, *kv)
    q = [desc[k].unsqueeze(-1) for k in ("q_sample", "q_anchor", "q_block")]
    return visible(*q, *kv)


def make_mask_mod(desc: dict[str, torch.Tensor], sliding: bool = False):
    """flex_attention mask_mod over batched descriptors ([R, Q] and [R, S+Q])."""
    qs, qa, qb = desc["q_sample"], desc["q_anchor"], desc["q_block"]
    ks, kp, kb = desc["kv_sample"], desc["kv_pos"], desc["kv_block"]
    if sliding:
        qp, qw = desc["q_pos"], desc["q_window_lo"]

        def sliding_mod(b, h, q_idx, kv_idx):
            return visible_sliding(qs[b, q_idx], qa[b, q_idx], qb[b, q_idx], qp[b, q_idx], qw[b, q_idx],
                                   ks[b, kv_idx], kp[b, kv_idx], kb[b, kv_idx])

        return sliding_mod

    def mask_mod(b, h, q_idx, kv_idx):
        return visible(qs[b, q_idx], qa[b, q_idx], qb[b, q_idx], ks[b, kv_idx], kp[b, kv_idx], kb[b, kv_idx])

    return mask_mod


def batched(meta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if meta["kv_num_blocks"].dim() == 1:  # a single row
        return {k: v.unsqueeze(0) for k, v in meta.items()}
    return meta


def to_block_mask(meta: dict[str, torch.Tensor], tile: int = TILE):
    """BlockMask for R stacked rows (or one row), via BlockMask.from_kv_blocks; heads broadcast.

    Metadata with sliding-window tiles gives {"full_attention": BlockMask, "sliding_attention":
    BlockMask} (both over the same descriptors); the drafter picks one per layer."""
    from torch.nn.attention.flex_attention import BlockMask

    meta = batched(meta)
    Q, SQ = meta["q_sample"].shape[-1], meta["kv_sample"].shape[-1]

    def build(prefix: str, sliding: bool):
        return BlockMask.from_kv_blocks(
            meta[prefix + "kv_num_blocks"].unsqueeze(1),
            meta[prefix + "kv_indices"].unsqueeze(1),
            meta[prefix + "full_kv_num_blocks"].unsqueeze(1),
            meta[prefix + "full_kv_indices"].unsqueeze(1),
            BLOCK_SIZE=tile,
            mask_mod=make_mask_mod(meta, sliding),
            seq_lengths=(Q, SQ),
        )

    if has_sliding(meta):
        return {FULL_ATTENTION: build("", False), SLIDING_ATTENTION: build(SLIDING, True)}
    return build("", False)


def _tile_map(num: torch.Tensor, idx: torch.Tensor, n_kv_tiles: int) -> torch.Tensor:
    """[..., Qt] counts + [..., Qt, W] indices -> bool [..., Qt, n_kv_tiles]."""
    used = torch.arange(idx.shape[-1], device=idx.device) < num.unsqueeze(-1)
    out = torch.zeros(*idx.shape[:-1], n_kv_tiles + 1, dtype=torch.bool, device=idx.device)
    out.scatter_(-1, torch.where(used, idx.long(), n_kv_tiles), True)  # unused slots land in a spare column
    return out[..., :n_kv_tiles]


def block_mask_to_dense(bm):
    """Bool [R, H, Q, KV] exactly as flex_attention applies a BlockMask: full tiles on, partial tiles
    through mask_mod, other tiles off. Eager and dense: for CPU training and checks on small inputs.
    A {layer type: BlockMask} dict gives the same dict of dense masks."""
    from torch.nn.attention.flex_attention import create_mask

    if isinstance(bm, dict):
        return {k: block_mask_to_dense(v) for k, v in bm.items()}

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


def to_dense_mask(meta: dict[str, torch.Tensor]):
    """Bool [R, 1, Q, S+Q] for the model's SDPA path (small inputs, CPU, debugging); with sliding-window
    tiles in `meta`, {"full_attention": mask, "sliding_attention": mask} as to_block_mask gives."""
    meta = batched(meta)
    if has_sliding(meta):
        return {FULL_ATTENTION: dense_mask(meta).unsqueeze(1), SLIDING_ATTENTION: dense_mask(meta, True).unsqueeze(1)}
    return dense_mask(meta).unsqueeze(1)
