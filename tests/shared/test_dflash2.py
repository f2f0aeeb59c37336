"""The DFlash2 drafter (docs/DESIGN.md §11) against a dense re-implementation written from the engines'
code, reading the drafter's weights by their exported names:

- vllm-project/vllm `vllm/model_executor/models/qwen3_dflash2.py`: `_grouped_conv` (coefficients
  base_kernel[side] + kernel_projection(x) per tap and group, taps reading q - t only where the query's
  block position is >= t), `DFlash2Qwen3DecoderLayer.forward` (the residual carried beside the stream and
  added by the next norm; the attention conv around self_attn, the MLP conv around the MLP),
  `_score_edges` (the K x K lattice: unary + <predecessor_codebook[p] * hidden_projection(h),
  successor_codebook[c]>, position 0's predecessor the anchor), `compute_candidates` (top-K of the lm_head
  logits, times output_multiplier, then cap * tanh(x / cap));
- vllm `vllm/model_executor/models/qwen3_dflash.py`: the context K/V (`precompute_and_store_context_kv`:
  hidden_norm, each layer's k/v rows of qkv_proj, k_norm, RoPE), q/k/v split of the stacked qkv_proj;
- the walk: SGLang's `python/sglang/srt/models/dflash.py` (`CandidateSelector.sample_path`, greedy rows:
  argmax of slot 0, then the argmax of the row of the previous choice) and sgl-project/SpecForge
  `specforge/modeling/draft/dflash2.py` (`CandidateSelector.greedy_path`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash.drafter import DFlash2Drafter, DFlashDrafter, DrafterConfig, build_drafter, masks, with_arch

B, S = 8, 40


def base_config(**kw) -> DrafterConfig:
    d = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=96, vocab_size=300, num_target_layers=4, target_layer_ids=[1, 2], mask_token_id=299,
             block_size=B, rope_theta=10000.0)
    d.update(kw)
    return DrafterConfig(**d)


def random_dflash2(seed=0, **knobs) -> DFlash2Drafter:
    """A DFlash2 drafter whose every weight is random (convolutions and selector far from their init)."""
    knobs = dict(dict(conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=5), **knobs)
    drafter = build_drafter(with_arch(base_config(), "dflash2", **knobs))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.3 * noise / max(1, p.shape[-1]) ** 0.5
                    if p.dim() == 2 else 0.5 * noise)
    return drafter.eval()


# ----------------------------------------------------------------------------- the dense reference


def rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, hd, theta):
    inv = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
    f = pos.float()[:, None] * inv
    cos, sin = torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]


def engine_conv(x, delta, base, block, groups, taps):
    """vLLM's _grouped_conv over flattened tokens x [N, H] of whole blocks."""
    blocks = x.unflatten(-1, (groups, x.shape[-1] // groups))
    coef = base.view(1, taps, groups, -1) + delta.unsqueeze(-1)
    out = coef[:, 0] * blocks
    pos = torch.arange(x.shape[0]) % block
    for t in range(1, taps):
        out = out + coef[:, t] * F.pad(blocks[:-t], (0, 0, 0, 0, t, 0)) * (pos >= t).view(-1, 1, 1)
    return out.flatten(-2)


def engine_block(w: dict, cfg, ctx_feat, ctx_pos, embeds, block_pos):
    """One block (embeds [B, H] at block_pos) over context features [S', L*H] at ctx_pos, as vLLM runs it."""
    nh, nkv, hd, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    G, taps = H // cfg.conv_group_size, cfg.conv_kernel_size
    ctx = rms(ctx_feat @ w["fc.weight"].t(), w["hidden_norm.weight"])
    hidden, residual = embeds, None
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        qkv = torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])  # the loader's stacked qkv_proj
        q_rows, kv_rows = nh * hd, nkv * hd

        def conv(name, x, p=p):  # the input side's convolution and the output side's coefficients
            proj = (x @ w[p + name + ".kernel_projection.weight"].t()).view(len(x), 2, taps, G)
            return engine_conv(x, proj[:, 0], w[p + name + ".base_kernel"][0], B, G, taps), proj[:, 1]

        residual = hidden if residual is None else hidden + residual
        x = rms(residual, w[p + "input_layernorm.weight"])
        x, coef = conv("attention_conv", x)
        q, k, v = (x @ qkv.t()).split([q_rows, kv_rows, kv_rows], -1)
        q = rope(rms(q.view(-1, nh, hd), w[p + "self_attn.q_norm.weight"]), block_pos, hd, cfg.rope_theta)
        k = rope(rms(k.view(-1, nkv, hd), w[p + "self_attn.k_norm.weight"]), block_pos, hd, cfg.rope_theta)
        ck, cv = (ctx @ qkv[q_rows:].t()).split([kv_rows, kv_rows], -1)  # precompute_and_store_context_kv
        ck = rope(rms(ck.view(-1, nkv, hd), w[p + "self_attn.k_norm.weight"]), ctx_pos, hd, cfg.rope_theta)
        K = torch.cat([ck, k]).repeat_interleave(nh // nkv, 1)
        V = torch.cat([cv.view(-1, nkv, hd), v.view(-1, nkv, hd)]).repeat_interleave(nh // nkv, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, K) * hd**-0.5, -1)  # non-causal, all context
        a = torch.einsum("hqk,khd->qhd", att, V).reshape(len(x), -1) @ w[p + "self_attn.o_proj.weight"].t()
        a = engine_conv(a, coef, w[p + "attention_conv.base_kernel"][1], B, G, taps)
        residual = a + residual
        x = rms(residual, w[p + "post_attention_layernorm.weight"])
        x, coef = conv("mlp_conv", x)
        m = (F.silu(x @ w[p + "mlp.gate_proj.weight"].t()) * (x @ w[p + "mlp.up_proj.weight"].t()))
        hidden = engine_conv(m @ w[p + "mlp.down_proj.weight"].t(), coef, w[p + "mlp_conv.base_kernel"][1], B, G, taps)
    return rms(hidden + residual, w["norm.weight"])


def engine_proposals(w: dict, cfg, hidden, lm_head, anchor):
    """compute_candidates + _score_edges + the greedy walk over the lattice, hidden [L, H] of positions 1..L."""
    logits = hidden @ lm_head.t()
    values, ids = torch.topk(logits, cfg.selector_top_k, dim=-1)
    values = values * cfg.output_multiplier
    if cfg.final_logit_softcapping:
        values = torch.tanh(values / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
    h = hidden @ w["candidate_selector.hidden_projection.weight"].t()  # [L, r]
    pred_ids = torch.cat([torch.full((1, cfg.selector_top_k), int(anchor)), ids[:-1]])
    pred = w["candidate_selector.predecessor_codebook"][pred_ids]  # [L, p, r]
    succ = w["candidate_selector.successor_codebook"][ids]  # [L, c, r]
    lattice = values[:, None, :] + torch.einsum("lpr,lcr->lpc", pred * h[:, None], succ)
    out, p = [], 0  # position 0: every row of the lattice has the anchor as predecessor
    for lat, cand in zip(lattice, ids):
        c = int(lat[p].argmax())
        out.append(int(cand[c]))
        p = c
    return out


# ----------------------------------------------------------------------------- the tests


def test_forward_matches_the_engines_dense_computation():
    torch.manual_seed(1)
    drafter = random_dflash2()
    cfg, w = drafter.config, dict(drafter.state_dict())
    T = 128  # the masks' tile: the row holds one sample of S tokens and two blocks, padded to T
    ctx = torch.randn(1, T, 2 * cfg.hidden_size)
    anchors = [5, 23]
    embeds = torch.randn(1, T, cfg.hidden_size)
    block_pos = torch.zeros(1, T, dtype=torch.long)
    block_pos[0, : 2 * B] = torch.cat([torch.arange(a, a + B) for a in anchors])
    with torch.no_grad():
        # inference: one block at a time against a cache of the context before its anchor
        for j, a in enumerate(anchors):
            ref = engine_block(w, cfg, ctx[0, :a], torch.arange(a), embeds[0, j * B : (j + 1) * B], block_pos[0, j * B : (j + 1) * B])
            got = drafter.forward_step(ctx[:, :a], embeds[:, j * B : (j + 1) * B], torch.arange(a).view(1, -1),
                                       block_pos[:, j * B : (j + 1) * B], drafter.new_cache())[0]
            assert torch.allclose(got, ref, atol=2e-5), float((got - ref).abs().max())
            # training: both blocks packed in one row with the closed-form mask; the block convolutions
            # must not reach across the boundary between them
            meta = masks.mask_metadata([0], [S], [0, 0], anchors, B, T, T)
            packed = drafter(ctx, embeds, torch.arange(T).view(1, -1), block_pos, masks.to_dense_mask(meta))[0]
            assert torch.allclose(packed[j * B : (j + 1) * B], ref, atol=2e-5)
        assert ref.abs().max() > 0.5  # not a vacuous comparison of near-zero outputs


def test_dflash2_takes_the_context_kv_computed_once():
    """DFlash2's forward (its embedding scale, its convolved layers) passes the shared context keys and
    values through: the same output as from the context features."""
    drafter = random_dflash2(seed=2, input_embedding_scale=1.5)
    T, anchors = 128, [5, 23]
    ctx, embeds = torch.randn(1, T, 2 * drafter.config.hidden_size), torch.randn(1, T, drafter.config.hidden_size)
    pos, block_pos = torch.arange(T).view(1, -1), torch.zeros(1, T, dtype=torch.long)
    block_pos[0, : 2 * B] = torch.cat([torch.arange(a, a + B) for a in anchors])
    mask = masks.to_dense_mask(masks.mask_metadata([0], [S], [0, 0], anchors, B, T, T))
    with torch.no_grad():
        want = drafter(ctx, embeds, pos, block_pos, mask)
        got = drafter(None, embeds, None, block_pos, mask, ctx_kv=drafter.context_kv(ctx, pos))
    assert torch.equal(got, want) and want.abs().max() > 0.5


def test_fresh_dflash2_computes_what_dflash_computes():
    """Identity convolutions and a zero successor codebook at init (SpecForge's init): a new DFlash2 drafter
    is the DFlash drafter of the same weights, and its selector keeps the lm_head's argmax."""
    cfg = base_config()
    torch.manual_seed(0)
    d2 = build_drafter(with_arch(cfg, "dflash2", selector_rank=8, selector_top_k=5))
    torch.manual_seed(0)
    d1 = DFlashDrafter(cfg)  # the same seed: the same backbone weights
    s1, s2 = d1.state_dict(), d2.state_dict()
    assert all(torch.equal(s1[k], s2[k]) for k in s1) and torch.any(s1["fc.weight"] != 0)
    ctx, emb = torch.randn(1, S, 2 * cfg.hidden_size), torch.randn(1, B, cfg.hidden_size)
    pos, bpos = torch.arange(S).view(1, -1), torch.arange(S, S + B).view(1, -1)
    with torch.no_grad():
        h1 = d1.forward_step(ctx, emb, pos, bpos, d1.new_cache())
        h2 = d2.forward_step(ctx, emb, pos, bpos, d2.new_cache())
        head = torch.randn(cfg.vocab_size, cfg.hidden_size)
        props = d2.propose(h2[:, 1:], head, torch.tensor([3]))
    assert torch.equal(h1, h2)
    assert torch.equal(props[0], (h2[0, 1:] @ head.t()).argmax(-1))


@pytest.mark.parametrize("multiplier,cap", [(1.0, None), (0.7, 5.0)])
def test_proposals_are_the_engines_greedy_walk_over_the_lattice(multiplier, cap):
    drafter = random_dflash2(seed=2, output_multiplier=multiplier, final_logit_softcapping=cap)
    cfg, w = drafter.config, dict(drafter.state_dict())
    g = torch.Generator().manual_seed(3)
    head = 0.05 * torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)  # logits about as spread as the
    hidden = torch.randn(4, B - 1, cfg.hidden_size, generator=g)  # transitions of the codebooks below
    with torch.no_grad():
        for p in drafter.candidate_selector.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    anchors = torch.tensor([1, 50, 100, 7])
    got = drafter.propose(hidden, head, anchors)
    differs = 0
    for r in range(4):
        want = engine_proposals(w, cfg, hidden[r], head, anchors[r])
        assert got[r].tolist() == want
        differs += int(want != (hidden[r] @ head.t()).argmax(-1).tolist())
    assert differs > 0  # the selector reranks here: the walk is not just the lm_head's argmax


def test_config_round_trip_and_refusals():
    from dflash.drafter import DFlash2Config, config_from_hf_dict

    cfg = random_dflash2(output_multiplier=0.5, final_logit_softcapping=30.0, input_embedding_scale=2.0).config
    d = cfg.to_hf_dict()
    assert d["architectures"] == ["DFlash2DraftModel"] and d["model_type"] == "qwen3"
    assert {k: d["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                               "selector_top_k", "output_multiplier", "final_logit_softcapping",
                                               "input_embedding_scale")} == {
        "conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 5,
        "output_multiplier": 0.5, "final_logit_softcapping": 30.0, "input_embedding_scale": 2.0}
    assert config_from_hf_dict(d) == cfg and isinstance(config_from_hf_dict(d), DFlash2Config)
    assert type(config_from_hf_dict(base_config().to_hf_dict())) is DrafterConfig
    with pytest.raises(ValueError, match="conv_group_size 24 must divide"):
        with_arch(base_config(), "dflash2", conv_group_size=24)
    with pytest.raises(ValueError, match="selector_top_k"):
        with_arch(base_config(), "dflash2", selector_top_k=301)
    broken = dict(d, dflash_config={k: v for k, v in d["dflash_config"].items() if k != "selector_rank"})
    with pytest.raises(ValueError, match="selector_rank"):
        config_from_hf_dict(broken)
