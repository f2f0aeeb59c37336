"""Every supported target family: capture equals a direct forward, the frozen embedding and lm_head are
found whatever the wrapper's weight names (tied too), and the layer count comes from the text config.

The checkpoints are tiny random-init models saved with save_pretrained (tests/target_families.py),
including the Qwen3.5 vision-language wrapper whose language model lives under `model.language_model.*`.
"""

from __future__ import annotations

import pytest
import torch

from dflash.target_model.capture import Capture, decoder_layers, load_target
from dflash.target_model.files import default_target_layers, load_embed_and_head, target_identity
from target_families import FAMILIES, HYBRID, make_family_target

CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    torch.set_num_threads(1)
    d = make_family_target(tmp_path_factory.mktemp(request.param), request.param, num_layers=4)
    return request.param, d, load_target(d, torch.float32, CPU)


def test_layers_and_identity_come_from_the_text_config(family):
    name, d, model = family
    ident = target_identity(d)
    assert ident["num_hidden_layers"] == 4 == len(decoder_layers(model))
    assert ident["hidden_size"] == 64
    assert ident["vocab_size"] == model.config.get_text_config().vocab_size
    assert ident["model_type"] == name.removesuffix("_vl")
    if name in HYBRID:
        types = model.config.get_text_config().layer_types
        assert "linear_attention" in types and "full_attention" in types


def test_capture_equals_a_direct_forward(family):
    _, _, model = family
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.get_text_config().vocab_size - 8, (3, 13))
    lengths = torch.tensor([13, 9, 4])
    layers = [2, 0, 3]  # the last layer's output is taken after the final norm, like hidden_states[-1]
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True, use_cache=False)
    got = Capture(model, layers, topk=5, lm_head_chunk=7, compile="off")(ids, lengths)
    want = torch.cat([ref.hidden_states[i + 1] for i in layers], dim=-1)
    assert got["hidden"].shape == want.shape == (3, 13, 3 * 64)
    # padded rows: causal attention and causal linear attention never look right, so real positions match
    for b, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(got["hidden"][b, :n], want[b, :n], rtol=1e-5, atol=1e-5)
    lp, ix = torch.log_softmax(ref.logits.float(), dim=-1).topk(5, dim=-1)
    for b, n in enumerate(lengths.tolist()):
        assert torch.equal(got["topk_ids"][b, :n], ix[b, :n])
        torch.testing.assert_close(got["topk_logprobs"][b, :n], lp[b, :n], rtol=0, atol=1e-5)
    # early stop (top-k off) gives the same hidden states
    early = Capture(model, [0, 1], topk=0)(ids[:1])
    torch.testing.assert_close(early["hidden"], torch.cat([ref.hidden_states[1][:1], ref.hidden_states[2][:1]], -1))


def test_embedding_and_head_found_in_the_safetensors(family):
    _, d, model = family
    embed, head = load_embed_and_head(d)
    assert torch.equal(embed, model.get_input_embeddings().weight)
    assert torch.equal(head, model.get_output_embeddings().weight)
    assert not torch.equal(embed, head)  # untied: two different tensors


@pytest.mark.parametrize("name", ["qwen3_5_vl", "qwen3_next", "gpt_oss", "llama"])
def test_tied_embeddings(tmp_path, name):
    d = make_family_target(tmp_path, name, num_layers=2, tie_word_embeddings=True)
    model = load_target(d, torch.float32, CPU)
    embed, head = load_embed_and_head(d)
    assert torch.equal(embed, model.get_input_embeddings().weight)
    assert torch.equal(head, model.get_output_embeddings().weight) and torch.equal(head, embed)


@pytest.mark.parametrize("name", ["qwen3_5_vl", "qwen3_5_moe_vl"])
def test_vl_wrapper_loads_the_saved_language_model(tmp_path, name):
    """AutoModelForCausalLM on the VL checkpoint must give the wrapper's own text logits: the weights under
    model.language_model.* are loaded, not re-initialised."""
    import transformers as tf

    d = make_family_target(tmp_path, name, num_layers=2)
    wrapper_cls = tf.Qwen3_5ForConditionalGeneration if name == "qwen3_5_vl" else tf.Qwen3_5MoeForConditionalGeneration
    wrapper = wrapper_cls.from_pretrained(d, dtype=torch.float32).eval()
    model = load_target(d, torch.float32, CPU)
    ids = torch.randint(0, 500, (1, 11))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, wrapper(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    assert default_target_layers(len(decoder_layers(model)), 1) == [1]


@pytest.mark.slow  # a real precompute and two CPU training steps per family, ~5-10 s each
@pytest.mark.parametrize("name", ["qwen3_5_vl", "qwen3_5_moe_vl", "qwen3_next", "gpt_oss", "qwen3_moe", "qwen2"])
def test_precompute_and_train_on_the_family(tmp_path, name, capsys):
    import importlib.util
    import json
    import math

    from dflash.config import TrainConfig
    from dflash.train.launch import launch_train
    from helpers import build_store, make_conversations_jsonl

    d = make_family_target(tmp_path, name, num_layers=4)
    data = make_conversations_jsonl(tmp_path / "chats.jsonl", n=12, max_words=10)
    store = build_store(tmp_path / "store", d, data, max_length=96, writer="thread")
    said = capsys.readouterr().out
    hybrid = name in ("qwen3_5_vl", "qwen3_5_moe_vl", "qwen3_next")  # Gated DeltaNet layers: the kernels are named
    assert ("Gated DeltaNet (linear-attention) layers" in said) == hybrid, said
    if hybrid and importlib.util.find_spec("fla") is None:
        assert "flash-linear-attention is not installed" in said and "dflash[fla]" in said
    ident = json.loads((store / "manifest.json").read_text())["target"]
    assert ident["num_hidden_layers"] == 4 and ident["hidden_size"] == 64
    out = tmp_path / "run"
    launch_train(TrainConfig(store=str(store), target=str(d), out=str(out), gpus="cpu:1", block_size=4, num_layers=2,
                             token_budget=256, num_anchors=4, num_workers=1, compile="off", seed=0, steps=2,
                             save_every=2, warmup_steps=1))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 2 and math.isfinite(rows[-1]["loss"])
    # no --layer-types: a Qwen3.5/3.6 target gets its published drafters' layout, every other family all full
    drafter = json.loads((out / "config.json").read_text())["drafter"]
    if name.startswith("qwen3_5"):
        assert drafter["layer_types"] == ["sliding_attention", "full_attention"] and drafter["sliding_window"] == 2048
    else:
        assert drafter["layer_types"] == ["full_attention", "full_attention"] and not drafter.get("use_sliding_window")
    # what the engines would load: export --check, then the exported drafter decodes losslessly online
    from dflash.config import ExportConfig
    from dflash.evaluate.export import load_export, run_export
    from dflash.evaluate.run import load_prompts, online_eval
    from dflash.target_model.capture import load_target, load_tokenizer

    assert run_export(ExportConfig(source=str(out), out=str(tmp_path / "export"), check=True, dtype="fp32"))["check"]["ok"]
    target = load_target(d, torch.float32, CPU)
    prompts = load_prompts(make_conversations_jsonl(tmp_path / "prompts.jsonl", n=1, seed=5, max_words=8),
                           load_tokenizer(d))
    r = online_eval(target, load_export(tmp_path / "export"), prompts, max_new_tokens=12, eos_ids=set(), progress=False)
    assert r["lossless"] is True and r["new_tokens"] == 12


@pytest.mark.parametrize("num_layers, given, window, want", [
    (5, None, None, (["sliding"] * 4 + ["full"], 2048)),   # Qwen3.6-27B's published drafter
    (3, None, 512, (["sliding", "sliding", "full"], 512)),  # the window is the user's if given
    (1, None, None, (None, None)),                          # one layer stays full
    (2, ["full", "full"], None, (["full", "full"], None)),  # --layer-types wins
])
def test_qwen3_5_targets_default_to_the_published_drafter_layout(num_layers, given, window, want):
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig, Qwen3Config

    from dflash.config import TrainConfig
    from dflash.train.preflight import _layer_types

    cfg = TrainConfig(num_layers=num_layers, layer_types=given, sliding_window=window)
    for target_cfg in (Qwen3_5Config(), Qwen3_5MoeConfig(), Qwen3_5Config().get_text_config()):
        types, w, source = _layer_types(cfg, target_cfg)
        assert (types, w) == want, type(target_cfg).__name__
        assert ("Qwen3.5/3.6" in source) == (given is None and num_layers > 1)
    plain = TrainConfig(num_layers=num_layers, layer_types=given)
    assert _layer_types(plain, Qwen3Config())[:2] == ((given, None) if given else (None, None))


def test_the_language_models_embedding_wins_over_other_embed_tokens(tmp_path):
    """A VL checkpoint may hold other `*embed_tokens.weight` tensors (an MTP head...): the language model's is taken."""
    from safetensors.torch import load_file, save_file

    d = make_family_target(tmp_path, "qwen3_5_vl", num_layers=2)
    tensors = load_file(d / "model.safetensors")
    real = tensors["model.language_model.embed_tokens.weight"]
    tensors["a.mtp.embed_tokens.weight"] = torch.randn_like(real)  # sorts first in the file
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    embed, _ = load_embed_and_head(d)
    assert torch.equal(embed, real)
