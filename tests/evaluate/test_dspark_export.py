"""A DSpark drafter exported as vLLM loads it, checked key by key against a table written from its loader,
reloaded by `export --check`, and online decoding with its Markov walk (and its confidence choosing the
verified drafts) staying lossless against a real transformers target (docs/DESIGN.md §12).

Engine code read for the names, shapes and config fields (search corpus `code`): vllm-project/vllm
`vllm/model_executor/models/qwen3_dspark.py` (`DSparkMarkovHead`: markov_w1 a [vocab_size, markov_rank]
embedding, markov_w2 a [draft_vocab_size, markov_rank] head; `DSparkConfidenceHead`: proj [1, hidden_size +
markov_rank] with a bias, built when adaptive verification is on; `config.markov_rank` and
`confidence_head_with_markov` read at the top level; weights loaded under `model.`), vllm
`vllm/v1/worker/gpu/spec_decode/dspark/speculator.py` (`dspark_bonus_anchor` selects the 1 + N block).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from helpers import make_conversations_jsonl, make_tiny_target

B, RANK = 8, 8


def engine_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """What vLLM's Qwen3DSparkForCausalLM allocates for this config (with a confidence head), from its code."""
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size  # noqa: E741
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    shapes = {"fc.weight": (H, len(cfg.target_layer_ids) * H), "hidden_norm.weight": (H,), "norm.weight": (H,),
              "markov_head.markov_w1.weight": (V, RANK), "markov_head.markov_w2.weight": (V, RANK),
              "confidence_head.proj.weight": (1, H + RANK), "confidence_head.proj.bias": (1,)}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "self_attn.q_proj.weight": (nh * hd, H), p + "self_attn.k_proj.weight": (nkv * hd, H),
                       p + "self_attn.v_proj.weight": (nkv * hd, H), p + "self_attn.o_proj.weight": (H, nh * hd),
                       p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                       p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                       p + "mlp.down_proj.weight": (H, I)})
    return shapes


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from dflash.drafter import DrafterConfig, build_drafter, with_arch
    from dflash.evaluate.run import load_prompts
    from dflash.target_model.capture import load_target, load_tokenizer

    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("dspark")
    target_dir = make_tiny_target(tmp, num_layers=4)
    tok = load_tokenizer(target_dir)
    target = load_target(target_dir, torch.float32, torch.device("cpu"))
    prompts = load_prompts(make_conversations_jsonl(tmp / "chats.jsonl", n=3, seed=5), tok)
    cfg = with_arch(DrafterConfig.from_target(target.config, num_layers=2, block_size=B, target_layer_ids=[1, 2],
                                              mask_token_id=len(tok)), "dspark", markov_rank=RANK)
    torch.manual_seed(0)
    drafter = build_drafter(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # heads strong enough to change the lm_head's argmax and the verified length
        drafter.markov_head.markov_w1.weight.copy_(torch.randn(drafter.markov_head.markov_w1.weight.shape, generator=g))
        drafter.markov_head.markov_w2.weight.copy_(torch.randn(drafter.markov_head.markov_w2.weight.shape, generator=g))
        # sigmoid ~ 0.62 at every position: survival 0.62, 0.38, 0.24, ... so a 0.3 threshold verifies ~2 drafts
        drafter.confidence_head.proj.weight.normal_(0, 0.002, generator=g)
        drafter.confidence_head.proj.bias.fill_(0.5)
    return tmp, target_dir, target, prompts, drafter.eval()


def test_export_matches_the_engine_loader_key_by_key(setup):
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
    assert hf["architectures"] == ["Qwen3DSparkModel"] and hf["model_type"] == "qwen3"
    assert hf["markov_rank"] == RANK and type(hf["markov_rank"]) is int and hf["markov_head_type"] == "vanilla"
    assert hf["confidence_head_with_markov"] is True and hf["enable_confidence_head"] is True
    assert hf["dspark_bonus_anchor"] is True and hf["block_size"] == B
    dc = hf["dflash_config"]
    assert dc["mask_token_id"] == drafter.config.mask_token_id and dc["target_layer_ids"] == [1, 2]
    assert dc["projector_type"] == "dspark" and dc["markov_rank"] == RANK
    assert hf["eagle_aux_hidden_state_layer_ids"] == [2, 3]


def test_an_export_with_a_changed_head_fails_the_check(setup):
    from dflash.evaluate.export import check_export, export_drafter

    tmp, _, _, _, drafter = setup
    export_drafter(drafter, tmp / "bad", torch.float32)
    assert check_export(tmp / "bad", drafter, torch.float32)["ok"]
    for change in ("markov_head.markov_w2.weight", "confidence_head.proj.bias"):
        other = type(drafter)(drafter.config)
        other.load_state_dict(drafter.state_dict())
        with torch.no_grad():
            other.get_parameter(change).add_(0.5)  # only this head differs
        assert not check_export(tmp / "bad", other.eval(), torch.float32)["ok"], change


def test_online_eval_drafts_the_markov_walk_and_stays_lossless_both_ways(setup):
    from dflash.evaluate.export import load_export
    from dflash.evaluate.run import online_eval

    tmp, _, target, prompts, drafter = setup
    served = load_export(tmp / "export", torch.float32) if (tmp / "export").exists() else drafter
    walks = []
    original = served.propose_with_confidence

    def spy(hidden, head, anchor):
        out, conf = original(hidden, head, anchor)
        plain = (hidden.float() @ head.float().t()).argmax(-1)
        walks.append(bool((out != plain).any()))
        return out, conf

    served.propose_with_confidence = spy
    r = online_eval(target, served, prompts, max_new_tokens=32, eos_ids=set(), progress=False,
                    confidence_threshold=0.3)
    assert r["lossless"] is True and r["mismatches"] == []
    assert r["new_tokens"] == 32 * len(prompts) and 1.0 <= r["tau"] <= B
    c = r["confidence"]
    assert c["lossless"] is True and c["threshold"] == 0.3 and 1.0 <= c["tau"] <= B
    assert 1.0 <= c["drafts_verified_per_step"] <= 3.0  # the confidence trimmed the blocks
    assert any(walks)  # the Markov walk, not the lm_head argmax
