"""A DFlash2 drafter exported as the engines load it, checked key by key against their loaders, reloaded by
`export --check`, and speculative decoding with its selector's proposals staying lossless (docs/DESIGN.md §11).

Engine code read for the names and shapes (search corpus `code`): vllm-project/vllm
`vllm/model_executor/models/qwen3_dflash2.py` (`DFlashGroupedConv`: base_kernel [2, taps, hidden],
kernel_projection [2 * taps * hidden / conv_group_size, hidden]; `CandidateSelector`: predecessor_codebook
and successor_codebook [vocab_size, selector_rank], hidden_projection [selector_rank, hidden]; the layer's
`attention_conv` / `mlp_conv`, the model's `candidate_selector`; dflash_config's conv_kernel_size,
conv_group_size, selector_rank, selector_top_k read with int(...[key]), output_multiplier and
final_logit_softcapping with .get), vllm `vllm/model_executor/models/qwen3_dflash.py` (the DFlash
backbone's names), sgl-project/SpecForge `specforge/modeling/draft/dflash2.py` ("names match SGLang's
DFlash2DraftModel").
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from helpers import make_conversations_jsonl, make_tiny_target

B = 8


def engine_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """What the engines' loaders allocate for a DFlash2DraftModel of this config, written from their code."""
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size  # noqa: E741
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    taps, groups, r = cfg.conv_kernel_size, H // cfg.conv_group_size, cfg.selector_rank
    shapes = {"fc.weight": (H, len(cfg.target_layer_ids) * H), "hidden_norm.weight": (H,), "norm.weight": (H,),
              "candidate_selector.predecessor_codebook": (V, r), "candidate_selector.successor_codebook": (V, r),
              "candidate_selector.hidden_projection.weight": (r, H)}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "self_attn.q_proj.weight": (nh * hd, H), p + "self_attn.k_proj.weight": (nkv * hd, H),
                       p + "self_attn.v_proj.weight": (nkv * hd, H), p + "self_attn.o_proj.weight": (H, nh * hd),
                       p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                       p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                       p + "mlp.down_proj.weight": (H, I)})
        for conv in ("attention_conv", "mlp_conv"):
            shapes[p + conv + ".base_kernel"] = (2, taps, H)
            shapes[p + conv + ".kernel_projection.weight"] = (2 * taps * groups, H)
    return shapes


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from dflash.drafter import DrafterConfig, build_drafter, with_arch
    from dflash.evaluate.run import load_prompts
    from dflash.target_model.capture import load_target, load_tokenizer

    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("dflash2")
    target_dir = make_tiny_target(tmp, num_layers=4)
    tok = load_tokenizer(target_dir)
    target = load_target(target_dir, torch.float32, torch.device("cpu"))
    prompts = load_prompts(make_conversations_jsonl(tmp / "chats.jsonl", n=3, seed=5), tok)
    cfg = with_arch(DrafterConfig.from_target(target.config, num_layers=2, block_size=B, target_layer_ids=[1, 2],
                                              mask_token_id=len(tok)),
                    "dflash2", conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=6,
                    output_multiplier=0.5, final_logit_softcapping=20.0)
    torch.manual_seed(0)
    drafter = build_drafter(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # convolutions and selector away from their identity / zero init
        for name, p in drafter.named_parameters():
            if "_conv." in name or name.startswith("candidate_selector"):
                p.copy_(torch.randn(p.shape, generator=g) * (0.05 if "kernel_projection" in name else 1.0))
    return tmp, target_dir, target, prompts, drafter.eval()


def test_export_matches_the_engine_loaders_key_by_key(setup):
    from dflash.config import ExportConfig
    from dflash.evaluate.export import run_export
    from dflash.train.checkpoint import save_checkpoint

    tmp, target_dir, _, _, drafter = setup
    save_checkpoint(tmp / "run", 1, drafter.state_dict(), drafter.config.to_hf_dict(), {"step": 1},
                    {"train": {"target": str(target_dir)}})
    result = run_export(ExportConfig(source=str(tmp / "run"), out=str(tmp / "export"), check=True, dtype="fp32"))
    assert result["check"]["ok"] and result["check"]["config_round_trip"]

    with safe_open(str(tmp / "export" / "model.safetensors"), "pt") as f:
        got = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    want = engine_shapes(drafter.config)
    assert sorted(got) == sorted(want), (sorted(set(got) - set(want)), sorted(set(want) - set(got)))
    for k, shape in want.items():
        assert got[k] == shape, k

    hf = json.loads((tmp / "export" / "config.json").read_text())
    assert hf["architectures"] == ["DFlash2DraftModel"] and hf["model_type"] == "qwen3"
    dc = hf["dflash_config"]
    assert {k: dc[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")} == {
        "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 6}
    assert all(type(dc[k]) is int for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"))
    assert dc["output_multiplier"] == 0.5 and dc["final_logit_softcapping"] == 20.0
    assert dc["mask_token_id"] == drafter.config.mask_token_id and dc["target_layer_ids"] == [1, 2]
    assert hf["block_size"] == B and hf["eagle_aux_hidden_state_layer_ids"] == [2, 3]
    assert hf["vocab_size"] == drafter.config.vocab_size and hf["hidden_size"] == drafter.config.hidden_size


def test_a_dflash2_export_with_a_changed_selector_fails_the_check(setup):
    from dflash.evaluate.export import check_export, export_drafter

    tmp, _, _, _, drafter = setup
    export_drafter(drafter, tmp / "bad", torch.float32)
    other = type(drafter)(drafter.config)
    other.load_state_dict(drafter.state_dict())
    with torch.no_grad():
        other.candidate_selector.successor_codebook.mul_(-1.0)  # only the selector differs
    assert check_export(tmp / "bad", drafter, torch.float32)["ok"]
    assert not check_export(tmp / "bad", other.eval(), torch.float32)["ok"]


def test_online_eval_drafts_with_the_selector_and_stays_lossless(setup):
    from dflash.evaluate.export import load_export
    from dflash.evaluate.run import online_eval

    tmp, _, target, prompts, drafter = setup
    served = load_export(tmp / "export", torch.float32) if (tmp / "export").exists() else drafter
    calls, reranked = [], []
    original = served.propose

    def spy(hidden, head, anchor):
        out = original(hidden, head, anchor)
        calls.append(out)
        reranked.append(bool((out != (hidden.float() @ head.float().t()).argmax(-1)).any()))
        return out

    served.propose = spy
    r = online_eval(target, served, prompts, max_new_tokens=32, eos_ids=set(), progress=False)
    assert r["lossless"] is True and r["mismatches"] == []
    assert r["new_tokens"] == 32 * len(prompts) and 1.0 <= r["tau"] <= B
    assert len(calls) >= r["num_blocks"] > 0 and any(reranked)  # the selector's walk, not the lm_head argmax
