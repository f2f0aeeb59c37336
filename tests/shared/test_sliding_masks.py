"""Sliding-window drafter layers (docs/DESIGN.md §4): closed-form tiles against a dense reference built
from the definition, flex_attention against SDPA, and the drafter's per-layer masks, in training and
in online decoding's cached drafting step.

The definition, as vLLM (`qwen3_dflash.py`, `_resolve_layer_attention`: a `sliding_attention` layer is
causal with `sliding_window`) and SGLang (`dflash.py`: DECODER attention with window_left = W - 1) serve a
drafter: a block query at absolute position p sees the keys at positions p - W < j <= p of
[its own sample's context before the anchor, its own block].
"""

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dflash.drafter import masks

torch.set_num_threads(1)


def random_row(seed, B, n_samples=None, max_len=300, extra_q_tiles=0):
    rng = np.random.default_rng(seed)
    n = n_samples or int(rng.integers(1, 6))
    lens = rng.integers(2, max_len, size=n)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).tolist()
    S = -(-int(lens.sum()) // 128) * 128 + 128 * int(rng.integers(0, 2))
    b_sample, b_anchor = [], []
    for i, L in enumerate(lens):
        k = int(rng.integers(0, min(L - 1, 12) + 1))
        for a in sorted(rng.choice(int(L) - 1, size=k, replace=False)):
            b_sample.append(i)
            b_anchor.append(int(a))
    Q = max(-(-len(b_sample) * B // 128), 1) * 128 + 128 * extra_q_tiles
    return dict(sample_ctx_start=starts, sample_ctx_len=lens.tolist(), block_sample=b_sample,
                block_anchor=b_anchor, block_size=B, S=S, Q=Q)


def reference(row, window=None):
    """The definition with Python loops over (query, key), independent of masks.py."""
    S, Q, B = row["S"], row["Q"], row["block_size"]
    m = np.zeros((Q, S + Q), bool)
    for j, (s, a) in enumerate(zip(row["block_sample"], row["block_anchor"])):
        st = row["sample_ctx_start"][s]
        for k in range(B):
            p = a + k  # the query's absolute position
            for t in range(a):  # the sample's context before the anchor, at positions t
                m[j * B + k, st + t] = window is None or p - window < t <= p
            for k2 in range(B):  # its own block, at positions a + k2
                m[j * B + k, S + j * B + k2] = window is None or p - window < a + k2 <= p
    return torch.from_numpy(m)


def expand(meta, prefix="", sliding=False, tile=128):
    """Dense mask as flex_attention applies the metadata: full tiles on, partial through mask_mod."""
    Q, SQ = meta["q_sample"].shape[0], meta["kv_sample"].shape[0]
    mm = masks.make_mask_mod({k: v.unsqueeze(0) for k, v in meta.items()}, sliding)
    out = torch.zeros(Q, SQ, dtype=torch.bool)
    b = torch.zeros((), dtype=torch.long)
    for qt in range(Q // tile):
        qi = torch.arange(qt * tile, (qt + 1) * tile)[:, None]
        for i in range(int(meta[prefix + "full_kv_num_blocks"][qt])):
            kt = int(meta[prefix + "full_kv_indices"][qt, i])
            out[qi, torch.arange(kt * tile, (kt + 1) * tile)[None]] = True
        for i in range(int(meta[prefix + "kv_num_blocks"][qt])):
            kt = int(meta[prefix + "kv_indices"][qt, i])
            ki = torch.arange(kt * tile, (kt + 1) * tile)[None]
            out[qi, ki] = mm(b, b, qi, ki)
    return out


def tile_truth(dense, tile=128):
    t = dense.view(dense.shape[0] // tile, tile, dense.shape[1] // tile, tile)
    return t.any(3).any(1), t.all(3).all(1)


def used(num, idx, n):
    out = np.zeros((len(num), n), bool)
    for q in range(len(num)):
        out[q, idx[q, : int(num[q])].numpy()] = True
    return torch.from_numpy(out)


# Windows smaller than a block, equal to it, a few blocks, about the context, and far past any context.
CASES = [(seed, B, W) for seed in range(3) for B, W in ((16, 1), (16, 5), (16, 16), (10, 37), (16, 128), (4, 300),
                                                      (16, 4096))] + [(50, 160, 64), (51, 128, 200)]


@pytest.mark.parametrize("seed,B,W", CASES)
def test_sliding_metadata_matches_definition(seed, B, W):
    row = random_row(seed, B, extra_q_tiles=seed % 2)
    meta = masks.mask_metadata(**row, sliding_window=W)
    ref_full, ref_swa = reference(row), reference(row, W)
    # The descriptors' rule, the tiles as flex_attention applies them, and the dense path.
    assert torch.equal(masks.dense_mask(meta), ref_full)
    assert torch.equal(masks.dense_mask(meta, sliding=True), ref_swa)
    assert torch.equal(expand(meta), ref_full)
    assert torch.equal(expand(meta, masks.SLIDING, sliding=True), ref_swa)
    dense = masks.to_dense_mask(meta)
    assert torch.equal(dense[masks.FULL_ATTENTION][0, 0], ref_full)
    assert torch.equal(dense[masks.SLIDING_ATTENTION][0, 0], ref_swa)
    # Tile classes are exact: skipped tiles hold no visible key, full tiles only visible keys.
    n = (row["S"] + row["Q"]) // 128
    any_t, all_t = tile_truth(ref_swa)
    partial = used(meta["swa_kv_num_blocks"], meta["swa_kv_indices"], n)
    full = used(meta["swa_full_kv_num_blocks"], meta["swa_full_kv_indices"], n)
    assert torch.equal(full, all_t)
    assert torch.equal(partial | full, any_t)
    assert not (partial & full).any()


def test_window_skips_tiles_and_large_window_is_causal():
    """One long sample, many blocks: a small window touches far fewer tiles than a full layer; a window
    past every position is exactly the causal restriction of the full rule."""
    B, L = 16, 2000
    anchors = list(range(100, 1900, 60))
    row = dict(sample_ctx_start=[0], sample_ctx_len=[L], block_sample=[0] * len(anchors), block_anchor=anchors,
               block_size=B, S=2048, Q=512)
    small = masks.mask_metadata(**row, sliding_window=128)
    tiles = lambda m, p="": int((m[p + "kv_num_blocks"] + m[p + "full_kv_num_blocks"]).sum())  # noqa: E731
    assert tiles(small, masks.SLIDING) < 0.6 * tiles(small)  # 23 of 44 tiles here
    big = masks.mask_metadata(**row, sliding_window=10**6)
    full, swa = masks.dense_mask(big), masks.dense_mask(big, sliding=True)
    qpos = big["q_pos"][:, None]
    causal = torch.cat([torch.ones(row["Q"], row["S"], dtype=torch.bool), big["kv_pos"][None, row["S"]:] <= qpos], 1)
    assert torch.equal(swa, full & causal)
    assert not torch.equal(swa, full)  # inside a block a full layer is bidirectional, a sliding one is not


def test_bad_window_and_no_blocks():
    with pytest.raises(ValueError, match="sliding_window"):
        masks.mask_metadata([0], [10], [0], [3], 16, 128, 128, sliding_window=0)
    meta = masks.mask_metadata([0], [10], [], [], 16, 128, 128, sliding_window=8)
    assert not masks.dense_mask(meta, sliding=True).any()
    assert int(meta["swa_kv_num_blocks"].sum() + meta["swa_full_kv_num_blocks"].sum()) == 0


@pytest.mark.parametrize("W", [3, 16, 100, 1000])
def test_flex_attention_equals_sdpa_dense(W):
    from torch.nn.attention.flex_attention import flex_attention

    rows = [random_row(s, 16, n_samples=3, max_len=200) for s in (7, 8)]
    S, Q = max(r["S"] for r in rows), max(r["Q"] for r in rows)
    meta = masks.stack_metadata([masks.mask_metadata(**{**r, "S": S, "Q": Q}, sliding_window=W) for r in rows])
    bms, dense = masks.to_block_mask(meta), masks.to_dense_mask(meta)
    assert set(bms) == set(dense) == {masks.FULL_ATTENTION, masks.SLIDING_ATTENTION}
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, Q, 16, generator=g)
    k = torch.randn(2, 2, S + Q, 16, generator=g)
    v = torch.randn(2, 2, S + Q, 16, generator=g)
    for kind in bms:
        assert torch.equal(masks.block_mask_to_dense(bms[kind]), dense[kind])
        for i, r in enumerate(rows):
            assert torch.equal(dense[kind][i, 0], reference({**r, "S": S, "Q": Q},
                                                            W if kind == masks.SLIDING_ATTENTION else None))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = flex_attention(q, k, v, block_mask=bms[kind], enable_gqa=True)
        rows_on = dense[kind].any(-1, keepdim=True)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense[kind] | ~rows_on, enable_gqa=True)
        torch.testing.assert_close(out, torch.where(rows_on, ref, 0.0), atol=1e-5, rtol=1e-5)


def test_sliding_metadata_speed():
    import time

    rng = np.random.default_rng(0)
    lens = rng.integers(200, 2000, size=14)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    bs, ba = [], []
    for i, L in enumerate(lens):
        for a in sorted(rng.choice(L - 1, size=18, replace=False)):
            bs.append(i)
            ba.append(a)
    bs, ba = bs[:256], ba[:256]
    masks.mask_metadata(starts, lens, bs, ba, 16, 16384, 4096, sliding_window=2048)
    t = time.perf_counter()
    for _ in range(3):
        masks.mask_metadata(starts, lens, bs, ba, 16, 16384, 4096, sliding_window=2048)
    assert (time.perf_counter() - t) / 3 < 1.0


# ------------------------------------------------------------------------------------------ the drafter

H, NL = 32, 2  # hidden size, target layers read


def sliding_drafter(layer_types, W, B=4, seed=0):
    from dflash.drafter import DFlashDrafter, DrafterConfig

    cfg = DrafterConfig(hidden_size=H, num_hidden_layers=len(layer_types), num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, intermediate_size=64, vocab_size=50,
                        num_target_layers=8, target_layer_ids=[1, 3], mask_token_id=49, block_size=B,
                        rope_theta=10000.0, layer_types=layer_types, sliding_window=W)
    torch.manual_seed(seed)
    m = DFlashDrafter(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return m


def test_config_normalises_and_refuses():
    from dflash.drafter import DrafterConfig

    m = sliding_drafter(["sliding", "full_attention", "sliding_attention"], 8)
    assert m.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert DrafterConfig.from_hf_dict(m.config.to_hf_dict()) == m.config
    base = dict(hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                intermediate_size=64, vocab_size=50, num_target_layers=8, target_layer_ids=[1, 3], mask_token_id=49)
    assert DrafterConfig(**base).layer_types == ["full_attention"] * 2
    for bad, match in (({"layer_types": ["full"]}, "one entry per"), ({"layer_types": ["full", "local"]}, "full or"),
                       ({"layer_types": ["full", "sliding"]}, "sliding_window"),
                       ({"layer_types": ["full", "sliding"], "sliding_window": 0}, "sliding_window")):
        with pytest.raises(ValueError, match=match):
            DrafterConfig(**base, **bad)


def packed_row(B, T, anchors, seed=0):
    g = torch.Generator().manual_seed(seed)
    S, Q = 128, 128
    ctx = torch.zeros(1, S, NL * H)
    ctx[:, :T] = torch.randn(1, T, NL * H, generator=g)
    emb = torch.zeros(1, Q, H)
    emb[:, : len(anchors) * B] = torch.randn(1, len(anchors) * B, H, generator=g)
    bpos = torch.zeros(1, Q, dtype=torch.long)
    for j, a in enumerate(anchors):
        bpos[0, j * B : (j + 1) * B] = torch.arange(a, a + B)
    return ctx, emb, torch.arange(S).view(1, -1), bpos


def plain_forward(m, ctx, emb, ctx_pos, bpos, per_layer_masks):
    """The drafter restated layer by layer with explicit per-layer dense masks (no dflash.drafter.masks)."""
    from dflash.drafter.attention import attend
    from dflash.drafter.dflash import apply_rope

    c = m._context(ctx)
    crope, brope = m.rotary_emb(ctx_pos), m.rotary_emb(bpos)
    h = emb.clone()
    for layer, mk in zip(m.layers, per_layer_masks):
        a = layer.self_attn
        x = layer.input_layernorm(h)
        R, Q, _ = x.shape
        qh = a.q_norm(a.q_proj(x).view(R, Q, a.n_heads, a.head_dim)).transpose(1, 2)
        qh = apply_rope(qh, *brope)
        kc, vc = a.project_kv(c, crope)
        kb, vb = a.project_kv(x, brope)
        out = attend(qh, torch.cat([kc, kb], 2), torch.cat([vc, vb], 2), mk, a.head_dim**-0.5)
        h = h + a.o_proj(out.transpose(1, 2).reshape(R, Q, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return m.norm(h)


@pytest.mark.parametrize("W", [2, 4, 9, 1000])
def test_drafter_picks_the_mask_per_layer(W):
    B, T, anchors = 4, 40, [3, 17, 30]
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    m = sliding_drafter(types, W, B)
    ctx, emb, cpos, bpos = packed_row(B, T, anchors)
    row = dict(sample_ctx_start=[0], sample_ctx_len=[T], block_sample=[0] * 3, block_anchor=anchors, block_size=B,
               S=128, Q=128)
    meta = masks.mask_metadata(**row, sliding_window=W)
    per_layer = [reference(row, W if t == "sliding_attention" else None).view(1, 1, 128, 256) for t in types]
    with torch.no_grad():
        want = plain_forward(m, ctx, emb, cpos, bpos, per_layer)
        dense = m(ctx, emb, cpos, bpos, masks.to_dense_mask(meta))
        flex = m(ctx, emb, cpos, bpos, masks.to_block_mask(meta))
        all_full = m(ctx, emb, cpos, bpos, {k: v for k, v in masks.to_dense_mask(meta).items()
                                            if k == "full_attention"} | {"sliding_attention":
                                                                         masks.to_dense_mask(meta)["full_attention"]})
    n = len(anchors) * B
    torch.testing.assert_close(dense[:, :n], want[:, :n], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(flex[:, :n], want[:, :n], atol=2e-5, rtol=2e-5)
    assert (all_full[:, :n] - want[:, :n]).abs().max() > 1e-3  # the window matters
    with pytest.raises(ValueError, match="sliding"):
        m(ctx, emb, cpos, bpos, masks.to_dense_mask(masks.mask_metadata(**row)))  # no sliding tiles
    # CPU training path: a BlockMask dict under grad goes through SDPA with the same masks.
    m.train()
    out = m(ctx, emb, cpos, bpos, masks.to_block_mask(meta))
    out[:, :n].sum().backward()
    torch.testing.assert_close(out[:, :n].detach(), want[:, :n], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("W", [1, 3, 6, 100])
def test_forward_step_equals_training_forward(W):
    """Online drafting (cached context, fed incrementally, cropped) gives the training forward's output."""
    B = 4
    m = sliding_drafter(["sliding_attention", "full_attention"], W, B)
    g = torch.Generator().manual_seed(3)
    n1, n2 = 11, 6
    T = n1 + n2 + B + 3
    feats = torch.randn(1, T, NL * H, generator=g)
    emb = torch.randn(1, B, H, generator=g)

    def training(anchor):
        meta = masks.mask_metadata([0], [T], [0], [anchor], B, 128, 128, sliding_window=W)
        ctx = torch.zeros(1, 128, NL * H)
        ctx[:, :T] = feats
        blk = torch.zeros(1, 128, H)
        blk[:, :B] = emb
        bpos = torch.zeros(1, 128, dtype=torch.long)
        bpos[0, :B] = anchor + torch.arange(B)
        return m(ctx, blk, torch.arange(128).view(1, -1), bpos, masks.to_dense_mask(meta))[:, :B]

    pos = lambda a, b: torch.arange(a, b).view(1, -1)  # noqa: E731
    with torch.no_grad():
        cache = m.new_cache()
        s1 = m.forward_step(feats[:, :n1], emb, pos(0, n1), pos(n1, n1 + B), cache)
        torch.testing.assert_close(s1, training(n1), atol=2e-5, rtol=2e-5)
        s2 = m.forward_step(feats[:, n1:n1 + n2], emb, pos(n1, n1 + n2), pos(n1 + n2, n1 + n2 + B), cache)
        torch.testing.assert_close(s2, training(n1 + n2), atol=2e-5, rtol=2e-5)
        cache.crop(n1 + 2)
        s3 = m.forward_step(feats[:, :0], emb, pos(0, 0), pos(n1 + 2, n1 + 2 + B), cache)
        torch.testing.assert_close(s3, training(n1 + 2), atol=2e-5, rtol=2e-5)
        s0 = m.forward_step(feats[:, :0], emb, pos(0, 0), pos(0, B), m.new_cache())
        torch.testing.assert_close(s0, training(0), atol=2e-5, rtol=2e-5)


def test_speculative_loop_with_a_sliding_drafter(tmp_path):
    """dflash.evaluate.speculative with a sliding drafter: lossless, and every drafting step equals the
    training forward (sliding masks) for that anchor over the whole sequence's target features."""
    from transformers import AutoModelForCausalLM

    from dflash.drafter import DFlashDrafter, DrafterConfig
    from dflash.evaluate.speculative import LayerCapture, greedy_generate, speculative_generate
    from dflash.target_model.files import target_config
    from helpers import make_tiny_target

    target_dir = make_tiny_target(tmp_path)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tc = target_config(target_dir)
    B, W = 4, 5
    cfg = DrafterConfig.from_target(tc, num_layers=2, block_size=B, target_layer_ids=[1, 2],
                                    mask_token_id=tc.vocab_size - 1, layer_types=["sliding", "full"], sliding_window=W)
    torch.manual_seed(1)
    drafter = DFlashDrafter(cfg).eval()
    calls = []
    step = drafter.forward_step

    def spy(new_ctx, block_embeds, ctx_positions, block_positions, cache):
        h = step(new_ctx, block_embeds, ctx_positions=ctx_positions, block_positions=block_positions, cache=cache)
        calls.append((int(block_positions[0, 0]), block_embeds.clone(), h.clone()))
        return h

    drafter.forward_step = spy
    ids = list(range(5, 25))
    ref = greedy_generate(target, torch.tensor(ids), 24, set())
    got = speculative_generate(target, drafter, torch.tensor(ids), 24, set())
    assert got.tokens == ref.tokens
    seq = torch.tensor(ids + got.tokens)
    with LayerCapture(target, cfg.target_layer_ids) as cap, torch.no_grad():
        target(seq[None])
        feats = cap.features()[0]
    T, S = len(seq), 128 * -(-len(seq) // 128)
    assert len(calls) > 3
    for a, emb, h in calls:
        ctx = torch.zeros(1, S, feats.shape[-1])
        ctx[0, :T] = feats
        blk = torch.zeros(1, 128, cfg.hidden_size)
        blk[0, :B] = emb[0]
        bpos = torch.zeros(1, 128, dtype=torch.long)
        bpos[0, :B] = torch.arange(a, a + B)
        mask = masks.to_dense_mask(masks.mask_metadata([0], [T], [0], [a], B, S, 128, sliding_window=W))
        with torch.no_grad():
            out = drafter(ctx, blk, torch.arange(S)[None], bpos, mask)
        torch.testing.assert_close(out[0, :B], h[0], atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the compiled flex_attention kernels")
@pytest.mark.parametrize("W", [7, 64, 300])
def test_compiled_drafter_with_sliding_block_masks_on_cuda(W):
    """The training path on a GPU: a torch.compile'd drafter over {layer type: BlockMask} built by
    from_kv_blocks (no create_block_mask), outputs and gradients equal to SDPA with the dense masks."""
    from dflash.drafter import DFlashDrafter, DrafterConfig

    dev = torch.device("cuda")
    B = 16
    cfg = DrafterConfig(hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=32, intermediate_size=256, vocab_size=64, num_target_layers=8,
                        target_layer_ids=[1, 3], mask_token_id=63, block_size=B, rope_theta=10000.0,
                        layer_types=["sliding", "sliding", "full"], sliding_window=W)
    torch.manual_seed(0)
    ref = DFlashDrafter(cfg).to(dev)
    comp = DFlashDrafter(cfg).to(dev)
    comp.load_state_dict(ref.state_dict())
    compiled = torch.compile(comp)
    rows = [random_row(s, B, n_samples=4, max_len=500) for s in (11, 12)]
    S, Q = max(r["S"] for r in rows), max(r["Q"] for r in rows)
    meta = masks.stack_metadata([masks.mask_metadata(**{**r, "S": S, "Q": Q}, sliding_window=W) for r in rows])
    meta = {k: v.to(dev) for k, v in meta.items()}
    g = torch.Generator(device=dev).manual_seed(0)
    ctx = torch.randn(2, S, 2 * 128, device=dev, generator=g)
    emb = torch.randn(2, Q, 128, device=dev, generator=g)
    cpos = torch.arange(S, device=dev).expand(2, S)
    bpos = meta["q_pos"].clamp_min(0).long()
    real = (meta["q_sample"] >= 0).unsqueeze(-1)
    out_c = compiled(ctx, emb, cpos, bpos, masks.to_block_mask(meta))
    out_r = ref(ctx, emb, cpos, bpos, masks.to_dense_mask(meta))
    torch.testing.assert_close(out_c * real, out_r * real, atol=2e-4, rtol=2e-4)
    (out_c * real).square().sum().backward()
    (out_r * real).square().sum().backward()
    for (n, a), b in zip(comp.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=2e-3, rtol=2e-3, msg=n)
