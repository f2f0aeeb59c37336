"""masks.py against the dense rule, tile by tile and through flex_attention."""

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dflash.drafter import attention, masks

torch.set_num_threads(1)


def random_row(seed, B, n_samples=None, max_len=300, extra_q_tiles=0, gaps=False):
    """A packed row of random samples with random anchors (0..len-2), as the loader would build it."""
    rng = np.random.default_rng(seed)
    n = n_samples or int(rng.integers(1, 6))
    lens = rng.integers(2, max_len, size=n)
    starts, pos = [], 0
    for L in lens:
        pos += int(rng.integers(0, 40)) if gaps else 0
        starts.append(pos)
        pos += int(L)
    S = -(-max(pos, 1) // 128) * 128 + 128 * int(rng.integers(0, 2))
    b_sample, b_anchor = [], []
    for i, L in enumerate(lens):
        k = int(rng.integers(0, min(L - 1, 12) + 1))
        for a in sorted(rng.choice(int(L) - 1, size=k, replace=False)):
            b_sample.append(i)
            b_anchor.append(int(a))
    Q = max(-(-len(b_sample) * B // 128), 1) * 128 + 128 * extra_q_tiles
    return dict(sample_ctx_start=starts, sample_ctx_len=lens.tolist(), block_sample=b_sample,
                block_anchor=b_anchor, block_size=B, S=S, Q=Q)


def rule_by_loops(row):
    """The rule restated with plain Python loops, independent of masks.dense_mask."""
    S, Q, B = row["S"], row["Q"], row["block_size"]
    m = np.zeros((Q, S + Q), bool)
    for j, (s, a) in enumerate(zip(row["block_sample"], row["block_anchor"])):
        st = row["sample_ctx_start"][s]
        m[j * B:(j + 1) * B, st:st + a] = True
        m[j * B:(j + 1) * B, S + j * B:S + (j + 1) * B] = True
    return torch.from_numpy(m)


def expand(meta, tile=128):
    """Dense mask as flex_attention sees it: full tiles on, partial tiles through mask_mod, rest off."""
    Q, SQ = meta["q_sample"].shape[0], meta["kv_sample"].shape[0]
    batched = {k: v.unsqueeze(0) for k, v in meta.items()}
    mm = masks.make_mask_mod(batched)
    out = torch.zeros(Q, SQ, dtype=torch.bool)
    b = torch.zeros((), dtype=torch.long)
    for qt in range(Q // tile):
        qi = torch.arange(qt * tile, (qt + 1) * tile)[:, None]
        for i in range(int(meta["full_kv_num_blocks"][qt])):
            kt = int(meta["full_kv_indices"][qt, i])
            out[qi, torch.arange(kt * tile, (kt + 1) * tile)[None]] = True
        for i in range(int(meta["kv_num_blocks"][qt])):
            kt = int(meta["kv_indices"][qt, i])
            ki = torch.arange(kt * tile, (kt + 1) * tile)[None]
            out[qi, ki] = mm(b, b, qi, ki)
    return out


ROWS = [(seed, B) for seed in range(6) for B in (16, 10, 4)] + [(100, 160), (101, 128)]


@pytest.mark.parametrize("seed,B", ROWS)
def test_metadata_matches_rule(seed, B):
    row = random_row(seed, B, extra_q_tiles=seed % 2, gaps=seed % 3 == 0)
    meta = masks.mask_metadata(**row)
    ref = rule_by_loops(row)
    assert ref.any()
    assert torch.equal(masks.dense_mask(meta), ref)
    assert torch.equal(expand(meta), ref)
    # Exact tile classes: full tiles all visible, partial tiles mixed, omitted tiles all invisible.
    Qt, KVt = row["Q"] // 128, (row["S"] + row["Q"]) // 128
    tiles = ref.view(Qt, 128, KVt, 128).permute(0, 2, 1, 3).reshape(Qt, KVt, -1)
    t_any, t_all = tiles.any(-1), tiles.all(-1)
    for qt in range(Qt):
        full = set(meta["full_kv_indices"][qt, : meta["full_kv_num_blocks"][qt]].tolist())
        part = set(meta["kv_indices"][qt, : meta["kv_num_blocks"][qt]].tolist())
        assert not full & part
        assert full == set(torch.nonzero(t_all[qt]).flatten().tolist())
        assert part == set(torch.nonzero(t_any[qt] & ~t_all[qt]).flatten().tolist())
    for k, v in meta.items():
        assert v.dtype == torch.int32, k


def test_descriptors():
    row = dict(sample_ctx_start=[0, 5], sample_ctx_len=[5, 3], block_sample=[1, 0], block_anchor=[2, 0],
               block_size=4, S=128, Q=128)
    m = masks.mask_metadata(**row)
    assert m["q_sample"][:9].tolist() == [1, 1, 1, 1, 0, 0, 0, 0, -1]
    assert m["q_anchor"][:8].tolist() == [2] * 4 + [0] * 4
    assert m["kv_pos"][:9].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, -1]
    assert m["kv_sample"][:9].tolist() == [0] * 5 + [1] * 3 + [-1]
    assert m["kv_pos"][128:137].tolist() == [2, 3, 4, 5, 0, 1, 2, 3, -1]
    assert m["kv_block"][128:137].tolist() == [0] * 4 + [1] * 4 + [-1]
    d = masks.dense_mask(m)
    assert d[0, :8].tolist() == [False] * 5 + [True, True, False]  # strict: position 2 not visible
    assert not d[4, :128].any()  # anchor 0 sees no context
    assert not d[8:].any()  # padding queries see nothing


def test_no_blocks_and_bad_input():
    m = masks.mask_metadata([0], [10], [], [], 16, 128, 128)
    assert m["kv_num_blocks"].sum() == 0 and m["full_kv_num_blocks"].sum() == 0
    with pytest.raises(ValueError):
        masks.mask_metadata([0], [10], [0], [3], 16, 100, 128)  # S not a tile multiple
    with pytest.raises(ValueError):
        masks.mask_metadata([0], [10], [0] * 9, [3] * 9, 16, 128, 128)  # blocks overflow Q
    with pytest.raises(ValueError):
        masks.mask_metadata([120], [10], [0], [3], 16, 128, 128)  # sample past S
    with pytest.raises(ValueError):
        masks.mask_metadata([0], [10], [1], [3], 16, 128, 128)  # no such sample


def test_flex_attention_equals_sdpa_dense():
    from torch.nn.attention.flex_attention import flex_attention

    rows = [random_row(s, 16, n_samples=3, max_len=200) for s in (7, 8)]
    S = max(r["S"] for r in rows)
    Q = max(r["Q"] for r in rows)
    metas = [masks.mask_metadata(**{**r, "S": S, "Q": Q}) for r in rows]
    meta = masks.stack_metadata(metas)
    bm = masks.to_block_mask(meta)
    assert bm.shape == (2, 1, Q, S + Q)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, Q, 16, generator=g)
    k = torch.randn(2, 2, S + Q, 16, generator=g)
    v = torch.randn(2, 2, S + Q, 16, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    dense = masks.to_dense_mask(meta)
    rows_on = dense.any(-1, keepdim=True)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense | ~rows_on, enable_gqa=True)
    ref = torch.where(rows_on, ref, 0.0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_metadata_speed():
    """Worker-side cost at a realistic size (S=16384, Q=4096): far below a training step."""
    import time

    rng = np.random.default_rng(0)
    lens = rng.integers(200, 2000, size=14)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    assert starts[-1] + lens[-1] <= 16384
    bs, ba = [], []
    for i, L in enumerate(lens):
        for a in sorted(rng.choice(L - 1, size=18, replace=False)):
            bs.append(i)
            ba.append(a)
    bs, ba = bs[:256], ba[:256]
    masks.mask_metadata(starts, lens, bs, ba, 16, 16384, 4096)
    t = time.perf_counter()
    for _ in range(5):
        masks.mask_metadata(starts, lens, bs, ba, 16, 16384, 4096)
    dt = (time.perf_counter() - t) / 5
    print(f"mask_metadata S=16384 Q=4096: {dt * 1e3:.2f} ms")
    assert dt < 0.5


def test_block_mask_to_dense_matches_rule():
    rows = [random_row(s, 10, n_samples=4, max_len=250) for s in (3, 4)]
    S, Q = max(r["S"] for r in rows), max(r["Q"] for r in rows)
    meta = masks.stack_metadata([masks.mask_metadata(**{**r, "S": S, "Q": Q}) for r in rows])
    dense = masks.block_mask_to_dense(masks.to_block_mask(meta))
    assert dense.shape == (2, 1, Q, S + Q)
    assert torch.equal(dense, masks.to_dense_mask(meta))
    for i, r in enumerate(rows):
        assert torch.equal(dense[i, 0], rule_by_loops({**r, "S": S, "Q": Q}))


def _sdpa_reference(q, k, v, mask):
    rows_on = mask.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~rows_on, enable_gqa=True, scale=0.25)
    return torch.where(rows_on, out, 0.0)


@pytest.mark.parametrize("sliding", [False, True])
def test_tiled_sdpa_equals_dense_sdpa_with_gradients(sliding):
    """The CPU training path's tile-gathered SDPA gives dense SDPA's outputs and gradients on packed rows
    (two rows of different fill, empty padded query tiles, a sliding window)."""
    rows = [random_row(s, 8, n_samples=5, max_len=400, extra_q_tiles=1) for s in (3, 4)]
    S = max(r["S"] for r in rows) + 512  # room: each query tile sees a few of many key tiles
    Q = max(r["Q"] for r in rows)
    window = 48 if sliding else None
    meta = masks.stack_metadata([masks.mask_metadata(**{**r, "S": S, "Q": Q}, sliding_window=window)
                                 for r in rows])
    dense = masks.to_dense_mask(meta)
    mask = dense[masks.SLIDING_ATTENTION] if sliding else dense
    assert (~mask.any(-1)).any(), "the rows have queries that see nothing (padding)"
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(2, h, n, 16, generator=g, requires_grad=True) for h, n in ((4, Q), (2, S + Q), (2, S + Q))]
    ref = _sdpa_reference(*leaves, mask)
    got = attention.tiled_sdpa(*leaves, mask, 0.25)
    assert got is not None, "a sparse packed row takes the tiled path"
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    w = torch.randn(ref.shape, generator=g)
    for a, b in zip(torch.autograd.grad((ref * w).sum(), leaves), torch.autograd.grad((got * w).sum(), leaves)):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_tiled_sdpa_declines_what_it_cannot_speed_up():
    q, k = torch.zeros(1, 2, 128, 8), torch.zeros(1, 2, 256, 8)
    assert attention.tiled_sdpa(q, k, k, torch.ones(1, 1, 128, 256, dtype=torch.bool), 1.0) is None  # dense
    assert attention.tiled_sdpa(q[:, :, :100], k, k, torch.zeros(1, 1, 100, 256, dtype=torch.bool), 1.0) is None


@pytest.mark.parametrize("sliding", [False, True])
def test_tiled_mask_from_metadata_is_the_dense_rule(sliding):
    """to_tiled_mask builds, from the tile lists and descriptors alone, the mask tiled_sdpa attends with:
    scattered back over the keys it equals the dense rule, and attention through it equals dense SDPA."""
    rows = [random_row(s, 8, n_samples=5, max_len=400, extra_q_tiles=1) for s in (5, 6)]
    S, Q = max(r["S"] for r in rows) + 256, max(r["Q"] for r in rows)
    meta = masks.stack_metadata([masks.mask_metadata(**{**r, "S": S, "Q": Q}, sliding_window=48 if sliding else None)
                                 for r in rows])
    tiled, dense = attention.to_tiled_mask(meta), masks.to_dense_mask(meta)
    if sliding:
        tiled, dense = tiled[masks.SLIDING_ATTENTION], dense[masks.SLIDING_ATTENTION]
    R, qt, n = tiled.keys.shape
    seen = (tiled.attn & tiled.rows_on).view(R, qt, 128, n).to(torch.int8)
    back = torch.zeros(R, qt, 128, S + Q, dtype=torch.int8)
    back.scatter_add_(3, tiled.keys.unsqueeze(2).expand(R, qt, 128, n), seen)
    assert back.max() <= 1, "no key is gathered twice for a query"
    assert torch.equal(back.bool().view(R, 1, Q, S + Q), dense)
    assert n < (S + Q) // 2, "a query tile gathers a fraction of the row's keys"
    g = torch.Generator().manual_seed(1)
    leaves = [torch.randn(2, h, m, 16, generator=g) for h, m in ((4, Q), (2, S + Q), (2, S + Q))]
    torch.testing.assert_close(attention.tiled_sdpa(*leaves, tiled, 0.25), _sdpa_reference(*leaves, dense),
                               atol=1e-5, rtol=1e-5)


def test_tiled_mask_sees_each_key_once_where_query_tiles_differ_in_width():
    """Query tiles of one long sample with anchors near 300 and near 1050: the first sees 4 key tiles (2 of
    them entirely), the second 10, so the first's list is padded; a padding slot must not repeat a tile."""
    row = dict(sample_ctx_start=[0], sample_ctx_len=[1200], block_sample=[0] * 32, block_size=8, S=1280, Q=256,
               block_anchor=[300 + i for i in range(16)] + [1050 + i for i in range(16)])
    meta = masks.mask_metadata(**row)
    assert int(meta["full_kv_num_blocks"][0]) >= 2, "the row has entirely visible tiles"
    tiled = attention.to_tiled_mask(meta)
    R, qt, n = tiled.keys.shape
    seen = (tiled.attn & tiled.rows_on).view(R, qt, 128, n).to(torch.int8)
    back = torch.zeros(R, qt, 128, 1280 + 256, dtype=torch.int8)
    back.scatter_add_(3, tiled.keys.unsqueeze(2).expand(R, qt, 128, n), seen)
    assert back.max() == 1
    assert torch.equal(back.bool().view(1, 1, 256, -1), masks.to_dense_mask(meta))
