"""`train --drafter-init target`: the drafter's layers start as the target's last layers (dflash/train/drafter_init.py).

Real tiny targets (save_pretrained) and real stores; weights are read back from the run's checkpoints.  lr 0
keeps a one-step run's weights at their initial values (AdamW's update is lr x something, weight decay 0).
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dflash.config import TrainConfig
from dflash.errors import ConfigError
from dflash.train.launch import launch_train


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """(target, store): a 4-layer Qwen3 target and a store of its layers [1, 2]."""
    import transformers

    from helpers import build_store, make_conversations_jsonl, make_tiny_target

    d = tmp_path_factory.mktemp("init_qwen3")
    target = make_tiny_target(d)
    # norm weights other than 1 (a fresh model's), so that a copied norm differs from a default one
    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 + torch.rand_like(p))
    model.save_pretrained(target)
    return target, build_store(d / "store", target, make_conversations_jsonl(d / "chats.jsonl", 16), writer="thread")


def _cfg(target, store, out, **kw):
    base = dict(store=str(store), target=str(target), out=str(out), gpus="cpu:1", block_size=8, num_layers=2,
                steps=1, lr=0.0, warmup_steps=0, token_budget=256, num_anchors=8, num_workers=1, compile="off",
                seed=0, save_every=0)
    base.update(kw)
    return TrainConfig(**base)


def _final_weights(run: Path) -> dict[str, torch.Tensor]:
    ckpts = sorted((run / "checkpoints").glob("step-*"))
    return load_file(str(ckpts[-1] / "model.safetensors"))


def _target_tensors(target: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(target / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k).float() for k in f.keys()}


LAYER_TENSORS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                 "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                 "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                 "mlp.down_proj.weight")


@pytest.mark.slow
def test_the_last_target_layers_are_copied_and_nothing_else(qwen3, tmp_path):
    target, store = qwen3
    launch_train(_cfg(target, store, tmp_path / "target", drafter_init="target"))
    launch_train(_cfg(target, store, tmp_path / "random"))
    got, rand, tgt = _final_weights(tmp_path / "target"), _final_weights(tmp_path / "random"), _target_tensors(target)
    # a 2-layer drafter on a 4-layer target: drafter layers 0, 1 <- target layers 2, 3
    for i, j in ((0, 2), (1, 3)):
        for name in LAYER_TENSORS:
            assert torch.equal(got[f"layers.{i}.{name}"].float(), tgt[f"model.layers.{j}.{name}"]), (i, name)
            assert not torch.equal(rand[f"layers.{i}.{name}"], got[f"layers.{i}.{name}"]), (i, name)
    # fc and the drafter's own norms have no counterpart: the same seeded default init as a random run
    for name in ("fc.weight", "hidden_norm.weight", "norm.weight"):
        assert torch.equal(got[name], rand[name]), name
    assert torch.equal(got["norm.weight"], torch.ones_like(got["norm.weight"]))
    assert not torch.equal(got["norm.weight"].float(), tgt["model.norm.weight"])  # the target's final norm stays out
    record = json.loads((tmp_path / "target" / "config.json").read_text())["drafter_init"]
    assert record["mode"] == "target" and record["layer_map"] == {"0": 2, "1": 3}
    assert record["kept_default"] == ["fc.weight", "hidden_norm.weight", "norm.weight"]
    assert sorted(record["copied_per_layer"]) == sorted(LAYER_TENSORS)
    assert record["applied"].startswith("fresh run")
    assert json.loads((tmp_path / "random" / "config.json").read_text())["drafter_init"] == {"mode": "random"}


@pytest.mark.slow
def test_resume_keeps_the_checkpoint_and_copies_nothing(qwen3, tmp_path, monkeypatch):
    target, store = qwen3
    run = tmp_path / "run"
    launch_train(_cfg(target, store, run, drafter_init="target", steps=4, save_every=2, lr=3e-3, warmup_steps=1))
    ref = _final_weights(run)
    # back to step 2: drop the final checkpoint, then resume to step 4 from step 2's weights
    shutil.rmtree(run / "checkpoints" / "step-00000004")
    from dflash.train import drafter_init

    def no_copy(copies):
        raise AssertionError("a resumed run read the target's layers again")

    monkeypatch.setattr(drafter_init, "load", no_copy)
    launch_train(_cfg(target, store, run, drafter_init="target", steps=4, save_every=2, lr=3e-3, warmup_steps=1,
                      resume=True))
    resumed = _final_weights(run)
    assert resumed.keys() == ref.keys()
    for k in ref:
        assert torch.equal(resumed[k], ref[k]), k  # trained on from the checkpoint, as the uninterrupted run
    # and the weights did move away from the target's during those steps (else the check above proves nothing)
    assert not torch.equal(ref["layers.0.self_attn.q_proj.weight"].float(),
                           _target_tensors(target)["model.layers.2.self_attn.q_proj.weight"])
    record = json.loads((run / "config.json").read_text())["drafter_init"]
    assert record["applied"] == "resumed from step-00000002: the checkpoint's weights, nothing copied"


@pytest.mark.slow
def test_a_gated_attention_target_is_refused_through_the_cli(tmp_path):
    """Qwen3.5's full-attention q_proj also computes an output gate: twice the drafter's rows."""
    from helpers import build_store, make_conversations_jsonl
    from processes import invoke
    from target_families import make_family_target

    target = make_family_target(tmp_path, "qwen3_5_vl", num_layers=4)
    store = build_store(tmp_path / "store", target, make_conversations_jsonl(tmp_path / "c.jsonl", 8), max_length=96,
                        writer="thread")
    (tmp_path / "none.yaml").write_text("{}\n")
    rc, _, err = invoke(["--config", tmp_path / "none.yaml", "--store", store, "--target", target,
                         "--out", tmp_path / "run", "--gpus", "cpu:1", "--num-layers", "1", "--block-size", "8",
                         "--steps", "1", "--compile", "off", "--drafter-init", "target"], command="train",
                        cwd=tmp_path)
    assert rc == 1
    err = err.strip()
    assert str(target / "model.safetensors") in err
    assert "model.language_model.layers.3.self_attn.q_proj.weight of shape [128, 64]" in err
    assert "drafter's layers.0.self_attn.q_proj.weight is [64, 64]" in err
    assert "--drafter-init random" in err
    assert len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def _plan(target, num_layers):
    from dflash.drafter import DrafterConfig
    from dflash.target_model.files import default_target_layers, target_config
    from dflash.train.drafter_init import plan

    tcfg = target_config(target)
    text = tcfg.get_text_config()
    dcfg = DrafterConfig.from_target(tcfg, num_layers, 8, default_target_layers(text.num_hidden_layers, 2), 3)
    return plan(str(target), dcfg, tcfg)


def test_a_linear_attention_layer_is_refused(tmp_path):
    from target_families import make_family_target

    target = make_family_target(tmp_path, "qwen3_5_vl", num_layers=4)  # layers: linear, linear, linear, full
    with pytest.raises(ConfigError, match=r"its layer 2 \(for drafter layer 0\) is linear_attention, not attention"):
        _plan(target, 2)


def test_an_moe_layer_is_refused(tmp_path):
    from target_families import make_family_target

    target = make_family_target(tmp_path, "qwen3_moe", num_layers=4)
    with pytest.raises(ConfigError, match=r"no model\.layers\.3\.mlp\.down_proj\.weight in its safetensors"):
        _plan(target, 1)


def test_more_drafter_layers_than_target_layers_are_refused(tmp_path):
    from helpers import make_tiny_target

    target = make_tiny_target(tmp_path, num_layers=2)
    with pytest.raises(ConfigError, match="the drafter has 3 layers and the target only 2"):
        _plan(target, 3)


def test_a_target_without_qk_norms_leaves_them_at_one(tmp_path):
    from helpers import make_tiny_target

    target = make_tiny_target(tmp_path, arch="llama")
    planned = _plan(target, 2)
    assert planned["record"]["layer_map"] == {"0": 2, "1": 3}
    assert "layers.0.self_attn.q_norm.weight" in planned["record"]["kept_default"]
    assert "layers.1.self_attn.k_norm.weight" in planned["record"]["kept_default"]
    assert planned["copies"]["layers.1.mlp.down_proj.weight"] == (str(target / "model.safetensors"),
                                                                  "model.layers.3.mlp.down_proj.weight")
    assert not any("norm" in k and "layernorm" not in k for k in planned["copies"])
