"""The drafter against a plain re-implementation, across attention paths, and its inference cache."""

import math
import warnings

import pytest
import torch
import transformers

from dflash.drafter import DFlashDrafter, DrafterConfig, attention, masks
from dflash.drafter.dflash import DraftCache, drafter_logits, state_dict_keys

torch.set_num_threads(1)
warnings.filterwarnings("ignore", message=".*flex_attention.*")

H, NH, NKV, HD, L = 64, 4, 2, 16, 3


def tiny_config(num_layers=2, block_size=4, **kw):
    return DrafterConfig(hidden_size=H, num_hidden_layers=num_layers, num_attention_heads=NH,
                         num_key_value_heads=NKV, head_dim=HD, intermediate_size=96, vocab_size=50,
                         num_target_layers=8, target_layer_ids=[1, 3, 5], mask_token_id=49,
                         block_size=block_size, rope_theta=10000.0, **kw)


def make_drafter(seed=0, **kw):
    torch.manual_seed(seed)
    m = DFlashDrafter(tiny_config(**kw))
    with torch.no_grad():  # non-trivial norms so a swapped or skipped norm shows
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return m.eval()


def packed_batch(B, seed=0):
    """Two rows of packed samples with random anchors, features and embeddings."""
    g = torch.Generator().manual_seed(seed)
    rows = [dict(lens=[37, 90, 20], blocks=[(0, 0), (0, 30), (1, 5), (1, 88), (2, 18), (1, 44)]),
            dict(lens=[150], blocks=[(0, 1), (0, 129), (0, 140), (0, 64)])]
    S, Q = 256, 128
    metas, ctx_pos, blk_pos = [], torch.zeros(2, S, dtype=torch.long), torch.zeros(2, Q, dtype=torch.long)
    for r, row in enumerate(rows):
        starts = [sum(row["lens"][:i]) for i in range(len(row["lens"]))]
        for st, ln in zip(starts, row["lens"]):
            ctx_pos[r, st:st + ln] = torch.arange(ln)
        bs = [s for s, _ in row["blocks"]]
        ba = [a for _, a in row["blocks"]]
        for j, a in enumerate(ba):
            blk_pos[r, j * B:(j + 1) * B] = a + torch.arange(B)
        row.update(starts=starts, S=S)
        metas.append(masks.mask_metadata(starts, row["lens"], bs, ba, B, S, Q))
    meta = masks.stack_metadata(metas)
    ctx_hidden = torch.randn(2, S, L * H, generator=g)
    block_embeds = torch.randn(2, Q, H, generator=g)
    return rows, meta, ctx_hidden, block_embeds, ctx_pos, blk_pos


# --- an independent, deliberately plain implementation ---------------------------------------------

def rms(x, w, eps=1e-6):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta=10000.0):
    """x [N, heads, hd] at integer positions pos [N], rotate-half convention."""
    d = x.shape[-1]
    inv = torch.tensor([1.0 / theta ** (2 * i / d) for i in range(d // 2)])
    ang = pos.double()[:, None] * inv.double()[None, :]
    cos, sin = torch.cos(ang).float()[:, None, :], torch.sin(ang).float()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def reference_block(m, feats, ctx_pos, emb, blk_pos):
    """One block [B, H] attending to its visible context feats [n, L*H] (all visible) and itself."""
    sd = {k: v.detach() for k, v in m.state_dict().items()}
    ctx = rms(feats @ sd["fc.weight"].T, sd["hidden_norm.weight"])
    h = emb
    for i in range(len(m.layers)):
        p = f"layers.{i}."
        x = rms(h, sd[p + "input_layernorm.weight"])
        q = (x @ sd[p + "self_attn.q_proj.weight"].T).view(-1, NH, HD)
        q = rope(rms(q, sd[p + "self_attn.q_norm.weight"]), blk_pos)
        kv_in = torch.cat([ctx, x])
        kv_pos = torch.cat([ctx_pos, blk_pos])
        k = (kv_in @ sd[p + "self_attn.k_proj.weight"].T).view(-1, NKV, HD)
        k = rope(rms(k, sd[p + "self_attn.k_norm.weight"]), kv_pos)
        v = (kv_in @ sd[p + "self_attn.v_proj.weight"].T).view(-1, NKV, HD)
        heads = []
        for hh in range(NH):
            kvh = hh // (NH // NKV)
            scores = q[:, hh] @ k[:, kvh].T / math.sqrt(HD)
            heads.append(torch.softmax(scores, -1) @ v[:, kvh])
        h = h + torch.cat(heads, -1) @ sd[p + "self_attn.o_proj.weight"].T
        x = rms(h, sd[p + "post_attention_layernorm.weight"])
        gate = x @ sd[p + "mlp.gate_proj.weight"].T
        up = x @ sd[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    return rms(h, sd["norm.weight"])


# --- tests -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("B", [4, 16])
def test_forward_matches_plain_reference(B):
    m = make_drafter(block_size=B)
    rows, meta, ctx_hidden, emb, ctx_pos, blk_pos = packed_batch(B)
    with torch.no_grad():
        dense = m(ctx_hidden, emb, ctx_pos, blk_pos, masks.to_dense_mask(meta))
        flex = m(ctx_hidden, emb, ctx_pos, blk_pos, masks.to_block_mask(meta))
    torch.testing.assert_close(flex, dense, atol=2e-5, rtol=2e-5)
    for r, row in enumerate(rows):
        for j, (s, a) in enumerate(row["blocks"]):
            st = row["starts"][s]
            sl = slice(j * B, (j + 1) * B)
            ref = reference_block(m, ctx_hidden[r, st:st + a], ctx_pos[r, st:st + a], emb[r, sl], blk_pos[r, sl])
            torch.testing.assert_close(dense[r, sl], ref, atol=5e-5, rtol=5e-5)


def test_context_kv_computed_once_gives_the_same_blocks():
    """The walk computes each context's keys and values once (`context_kv`) and drafts block after block
    against them: the forward must give exactly what it gives from the context features."""
    B = 4
    m = make_drafter(block_size=B)
    _, meta, ctx_hidden, emb, ctx_pos, blk_pos = packed_batch(B)
    with torch.no_grad():
        kv = m.context_kv(ctx_hidden, ctx_pos)
        for mask in (masks.to_dense_mask(meta), attention.to_tiled_mask(meta)):
            want = m(ctx_hidden, emb, ctx_pos, blk_pos, mask)
            assert torch.equal(m(None, emb, None, blk_pos, mask, ctx_kv=kv), want)
        other = m(ctx_hidden, emb, ctx_pos, blk_pos, masks.to_dense_mask(meta),
                  ctx_kv=m.context_kv(ctx_hidden.flip(1), ctx_pos))
    assert [k.shape for k, _ in kv] == [(2, NKV, ctx_hidden.shape[1], HD)] * len(m.layers)
    assert not torch.allclose(other, want)  # the keys and values given are the ones used


def test_flex_and_sdpa_gradients_agree():
    """On CPU a BlockMask with grads falls back to SDPA (flex has no CPU backward); on CUDA it is flex."""
    B = 4
    rows, meta, ctx_hidden, emb, ctx_pos, blk_pos = packed_batch(B, seed=1)
    grads = []
    for mask in (masks.to_dense_mask(meta), masks.to_block_mask(meta)):
        m = make_drafter(block_size=B).train()
        out = m(ctx_hidden, emb, ctx_pos, blk_pos, mask)
        (out[:, : 6 * B] ** 2).sum().backward()  # padding queries included in the graph, not the loss
        grads.append({k: p.grad.clone() for k, p in m.named_parameters()})
    for k in grads[0]:
        assert torch.isfinite(grads[0][k]).all(), k
        torch.testing.assert_close(grads[1][k], grads[0][k], atol=1e-4, rtol=1e-4, msg=k)
    assert grads[0]["fc.weight"].abs().sum() > 0


def test_padding_rows_are_finite_in_sdpa_path():
    B = 4
    _, meta, ctx_hidden, emb, ctx_pos, blk_pos = packed_batch(B)
    m = make_drafter(block_size=B).train()
    out = m(ctx_hidden, emb, ctx_pos, blk_pos, masks.to_dense_mask(meta))
    out.sum().backward()  # padding rows contribute to the loss here on purpose
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())


def test_forward_step_equals_training_forward():
    B = 4
    m = make_drafter(block_size=B)
    g = torch.Generator().manual_seed(3)
    n1, n2 = 11, 6
    T = n1 + n2 + B + 3  # the sample continues past the anchor: those tokens must stay invisible
    feats = torch.randn(1, T, L * H, generator=g)
    emb = torch.randn(1, B, H, generator=g)

    def training(anchor):
        meta = masks.mask_metadata([0], [T], [0], [anchor], B, 128, 128)
        ctx_pos = torch.arange(128).view(1, -1)
        blk = torch.zeros(1, 128, H)
        blk[:, :B] = emb
        blk_pos = torch.zeros(1, 128, dtype=torch.long)
        blk_pos[0, :B] = anchor + torch.arange(B)
        ctx = torch.zeros(1, 128, L * H)
        ctx[:, :T] = feats
        outs = [m(ctx, blk, ctx_pos, blk_pos, mk)[:, :B]
                for mk in (masks.to_dense_mask(meta), masks.to_block_mask(meta))]
        torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=2e-5)
        return outs[0]

    pos = lambda a, b: torch.arange(a, b).view(1, -1)  # noqa: E731
    with torch.no_grad():
        cache = m.new_cache()
        assert isinstance(cache, DraftCache) and len(cache) == 0
        step1 = m.forward_step(feats[:, :n1], emb, pos(0, n1), pos(n1, n1 + B), cache)
        assert len(cache) == n1  # block keys are not kept
        torch.testing.assert_close(step1, training(n1), atol=2e-5, rtol=2e-5)
        step2 = m.forward_step(feats[:, n1:n1 + n2], emb, pos(n1, n1 + n2), pos(n1 + n2, n1 + n2 + B), cache)
        torch.testing.assert_close(step2, training(n1 + n2), atol=2e-5, rtol=2e-5)
        # Rejected context is cropped away, then the step is redone from the shorter context.
        cache.crop(n1 + 2)
        assert len(cache) == n1 + 2
        step3 = m.forward_step(feats[:, :0], emb, pos(0, 0), pos(n1 + 2, n1 + 2 + B), cache)
        torch.testing.assert_close(step3, training(n1 + 2), atol=2e-5, rtol=2e-5)
        # Anchor 0: no context at all.
        step0 = m.forward_step(feats[:, :0], emb, pos(0, 0), pos(0, B), m.new_cache())
        torch.testing.assert_close(step0, training(0), atol=2e-5, rtol=2e-5)


def test_state_dict_keys_and_init():
    m = DFlashDrafter(tiny_config(num_layers=3))
    sd = m.state_dict()
    assert sorted(sd) == sorted(state_dict_keys(3))
    assert "layers.2.self_attn.q_norm.weight" in sd and "layers.0.mlp.gate_proj.weight" in sd
    assert sd["fc.weight"].shape == (H, L * H)
    assert sd["layers.0.self_attn.k_proj.weight"].shape == (NKV * HD, H)
    assert torch.equal(sd["norm.weight"], torch.ones(H))
    assert abs(sd["layers.1.mlp.up_proj.weight"].std().item() - 0.02) < 0.003
    assert not any("rotary" in k or "inv_freq" in k for k in sd)


def test_config_from_target_and_hf_round_trip():
    tc = transformers.Qwen3Config(hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=300,
                                  rms_norm_eps=1e-5, rope_theta=5e5, max_position_embeddings=4096)
    cfg = DrafterConfig.from_target(tc, num_layers=2, block_size=8, target_layer_ids=None, mask_token_id=299)
    assert (cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads, cfg.intermediate_size) == (64, 16, 2, 128)
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling is None and cfg.rms_norm_eps == 1e-5
    assert cfg.num_target_layers == 8 and len(cfg.target_layer_ids) == 2 and cfg.vocab_size == 300
    d = cfg.to_hf_dict()
    assert d["architectures"] == ["DFlashDraftModel"] and d["model_type"] == "qwen3"
    assert d["dflash_config"]["mask_token_id"] == 299 and d["dflash_config"]["target_layer_ids"] == cfg.target_layer_ids
    assert d["block_size"] == 8 and d["num_target_layers"] == 8
    assert DrafterConfig.from_hf_dict(d) == cfg
    # transformers reads the export as an ordinary Qwen3 config with the same shape and rope.
    hf = transformers.Qwen3Config.from_dict(d)
    assert hf.num_hidden_layers == 2 and hf.head_dim == 16 and hf.rope_parameters["rope_theta"] == 5e5
    # A z-lab style config (rope_theta/rope_scaling spelling, unknown extras kept).
    zl = {k: v for k, v in d.items() if k != "rope_parameters"}
    zl["auto_map"] = {"AutoModel": "dflash.DFlashDraftModel"}
    back = DrafterConfig.from_hf_dict(zl)
    assert back.rope_theta == 5e5 and back.to_hf_dict()["auto_map"] == zl["auto_map"]


@pytest.mark.parametrize("scaling", [None, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
                                     {"rope_type": "linear", "factor": 2.0}])
def test_rope_matches_transformers(scaling):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    params = {"rope_type": "default", "rope_theta": 1e6, **(scaling or {})}
    tc = transformers.Qwen3Config(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=16, intermediate_size=128, vocab_size=300, max_position_embeddings=4096,
                                  rope_parameters=params)
    cfg = DrafterConfig.from_target(tc, num_layers=1, mask_token_id=1)
    assert cfg.rope_scaling == ({k: v for k, v in params.items() if k != "rope_theta"} if scaling else None)
    m = DFlashDrafter(cfg)
    pos = torch.tensor([[0, 1, 7, 100, 3000]])
    cos, sin = m.rotary_emb(pos)
    ref_cos, ref_sin = Qwen3RotaryEmbedding(tc)(torch.zeros(1, 5, 64), pos)
    torch.testing.assert_close(cos, ref_cos, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sin, ref_sin, atol=1e-5, rtol=1e-5)
    assert DrafterConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_logits_helper():
    hidden, w = torch.randn(2, 5, H), torch.randn(50, H)
    torch.testing.assert_close(drafter_logits(hidden, w), hidden @ w.T)


def test_compiled_drafter_with_flex_and_fresh_masks():
    """The training loop compiles the whole drafter once; a new BlockMask per batch must not recompile."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    B = 4
    m = make_drafter(num_layers=1, block_size=B)
    compiled = torch.compile(m)
    for seed in (0, 2):
        _, meta, ctx_hidden, emb, ctx_pos, blk_pos = packed_batch(B, seed=seed)
        with torch.no_grad():
            got = compiled(ctx_hidden, emb, ctx_pos, blk_pos, masks.to_block_mask(meta))
            want = m(ctx_hidden, emb, ctx_pos, blk_pos, masks.to_dense_mask(meta))
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert counters["stats"]["unique_graphs"] == 1


def test_meta_construction_then_init():
    """FSDP-style construction on the meta device, materialised with to_empty + init_weights."""
    B = 4
    with torch.device("meta"):
        m = DFlashDrafter(tiny_config(block_size=B))
    m.to_empty(device="cpu")
    m.init_weights()
    fresh = DFlashDrafter(tiny_config(block_size=B))
    torch.testing.assert_close(m.rotary_emb.inv_freq, fresh.rotary_emb.inv_freq)
    assert torch.equal(m.norm.weight, torch.ones(H))
    _, meta, ctx_hidden, emb, ctx_pos, blk_pos = packed_batch(B)
    with torch.no_grad():
        out = m(ctx_hidden, emb, ctx_pos, blk_pos, masks.to_dense_mask(meta))
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match="target layers"):
        m(ctx_hidden[..., :-1], emb, ctx_pos, blk_pos, masks.to_dense_mask(meta))
