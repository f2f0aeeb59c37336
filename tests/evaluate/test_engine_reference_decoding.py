"""Online decoding of a drafter with sliding and full layers against an independent decoding loop written
from the engines' semantics (vLLM `qwen3_dflash.py` / SGLang `dflash.py`, docs/DESIGN.md §9), not from
dflash's code: no KV caches, the target re-run over the whole sequence every step, and the drafter computed
densely from its exported weight names.

The engines' drafter, as read: context features `hidden_norm(fc(concat of the target layers' outputs))` for
every position before the anchor; the block `[anchor, MASK x (B-1)]` at positions `start..start+B-1`;
queries from the block only; keys and values `proj([context, normed block])` with the layer's own k/v
projections, per-head k_norm and RoPE at absolute positions; a full layer lets every block query see the
whole context and the whole block; a sliding layer lets the query at position p see the keys at
p - W < j <= p; then `o_proj`, SwiGLU MLP, final norm, the target's lm_head.  Greedy acceptance: the
longest prefix of proposals the target agrees with, then the target's own token as the next anchor.
"""

from __future__ import annotations

import math

import pytest
import torch

B, W = 4, 5  # a window shorter than most contexts here, so the sliding layer's keys are cut


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    """Neox-style rotary embedding over the last dim of x [T, heads, d] at absolute positions pos [T]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos().float()[:, None], torch.cat([ang, ang], -1).sin().float()[:, None]
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + half * sin


def engine_draft(sd: dict, cfg, feats: torch.Tensor, anchor: int, start: int, embed_w, head_w) -> torch.Tensor:
    """The B-1 proposals of one drafting step, dense, from the weights' names (see the module docstring)."""
    eps, nh, nkv, hd = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    ctx = _rms(feats @ sd["fc.weight"].T, sd["hidden_norm.weight"], eps)  # [start, H]
    h = embed_w[torch.tensor([anchor] + [cfg.mask_token_id] * (B - 1))]
    q_pos = torch.arange(start, start + B)
    kv_pos = torch.cat([torch.arange(start), q_pos])
    for i, kind in enumerate(cfg.layer_types):
        p = f"layers.{i}."
        xn = _rms(h, sd[p + "input_layernorm.weight"], eps)
        q = _rms((xn @ sd[p + "self_attn.q_proj.weight"].T).view(B, nh, hd), sd[p + "self_attn.q_norm.weight"], eps)
        src = torch.cat([ctx, xn])
        k = _rms((src @ sd[p + "self_attn.k_proj.weight"].T).view(-1, nkv, hd), sd[p + "self_attn.k_norm.weight"], eps)
        v = (src @ sd[p + "self_attn.v_proj.weight"].T).view(-1, nkv, hd)
        q, k = _rope(q, q_pos, cfg.rope_theta), _rope(k, kv_pos, cfg.rope_theta)
        seen = torch.ones(B, len(kv_pos), dtype=torch.bool)
        if kind == "sliding_attention":
            seen = (kv_pos[None] <= q_pos[:, None]) & (kv_pos[None] > q_pos[:, None] - cfg.sliding_window)
        out = torch.empty(B, nh, hd)
        for head in range(nh):
            kv = head // (nh // nkv)
            s = (q[:, head] @ k[:, kv].T) / math.sqrt(hd)
            out[:, head] = torch.softmax(s.masked_fill(~seen, float("-inf")), -1) @ v[:, kv]
        h = h + out.reshape(B, nh * hd) @ sd[p + "self_attn.o_proj.weight"].T
        xn = _rms(h, sd[p + "post_attention_layernorm.weight"], eps)
        gate, up = xn @ sd[p + "mlp.gate_proj.weight"].T, xn @ sd[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    return (_rms(h, sd["norm.weight"], eps)[1:] @ head_w.T).argmax(-1)


def engine_loop(target, cfg, sd, prompt: list[int], n_new: int, steer) -> tuple[list[int], list[int], list]:
    """Greedy speculative decoding without caches; returns (tokens, tokens per target forward, proposals)."""
    embed_w, head_w = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    seq = list(prompt)
    with torch.no_grad():
        out = target(torch.tensor([seq]), output_hidden_states=True)
        tokens, per_forward, drafts = [int(out.logits[0, -1].argmax())], [], []
        while len(tokens) < n_new:
            start, anchor = len(seq), tokens[-1]
            feats = torch.cat([out.hidden_states[i + 1][0, :start] for i in cfg.target_layer_ids], -1)
            proposals = engine_draft(sd, cfg, feats, anchor, start, embed_w, head_w)
            drafts.append((start, proposals.tolist()))
            proposals = steer(start, proposals)
            block = [anchor] + proposals.tolist()
            out = target(torch.tensor([seq + block]), output_hidden_states=True)
            posterior = out.logits[0, start:].argmax(-1)
            acc = 0
            while acc < B - 1 and block[acc + 1] == int(posterior[acc]):
                acc += 1
            per_forward.append(acc + 1)
            seq += block[: acc + 1]
            tokens += block[1 : acc + 1] + [int(posterior[acc])]
            out = target(torch.tensor([seq]), output_hidden_states=True)  # the accepted tokens' features
    return tokens[:n_new], per_forward, drafts


@pytest.mark.parametrize("layer_types", [["sliding", "full"], ["full", "sliding", "sliding"]])
def test_online_tau_equals_an_engine_semantics_loop(tmp_path, layer_types):
    from transformers import AutoModelForCausalLM

    from dflash.drafter import DFlashDrafter, DrafterConfig
    from dflash.evaluate.speculative import greedy_generate, speculative_generate
    from dflash.target_model.files import target_config
    from helpers import make_tiny_target

    torch.set_num_threads(1)
    target_dir = make_tiny_target(tmp_path)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tc = target_config(target_dir)
    cfg = DrafterConfig.from_target(tc, num_layers=len(layer_types), block_size=B, target_layer_ids=[0, 2],
                                    mask_token_id=tc.vocab_size - 1, layer_types=layer_types, sliding_window=W)
    torch.manual_seed(3)
    drafter = DFlashDrafter(cfg).eval()
    with torch.no_grad():  # weights large enough that the window changes the proposals
        for p in drafter.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    sd = {k: v.detach() for k, v in drafter.state_dict().items()}
    prompt, n_new = list(range(5, 17)), 28
    truth = greedy_generate(target, torch.tensor(prompt), n_new + B, set()).tokens

    def steer(start, proposals):
        """Accept a varying number of proposals per step (the drafter is untrained): the first k are made
        the target's own tokens and the next one wrong, with k depending on the step's position."""
        k = (start * 5) % B
        out = proposals.clone()
        for i in range(min(k, B - 1)):
            out[i] = truth[start + 1 + i - len(prompt)]
        if k < B - 1:
            out[k] = (truth[start + 1 + k - len(prompt)] + 1) % tc.vocab_size
        return out

    want_tokens, want_per_forward, want_drafts = engine_loop(target, cfg, sd, prompt, n_new, steer)
    raw = []

    def hook(start, proposals):
        raw.append((start, proposals.tolist()))
        return steer(start, proposals)

    got = speculative_generate(target, drafter, torch.tensor(prompt), n_new, set(), propose=hook)
    assert want_tokens == truth[:n_new] == got.tokens  # both lossless
    assert sorted(set(want_per_forward)) != [1], "the test must accept several tokens per step"
    assert got.acceptance == want_per_forward  # the same tau, step by step
    assert raw == want_drafts  # the drafter proposed what the engines' drafter would, at every step
    assert any(start > W for start, _ in raw)  # contexts longer than the window were drafted
