"""Export: DFlashDraftModel config fields, the exact key set, the logits round trip, `--check`, atomicity."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from helpers import make_tiny_target
from processes import invoke

B = 8
LAYERS = 2


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(run dir, checkpoint dir, drafter, target dir): a 2-layer drafter saved by dflash.checkpoint."""
    from dflash.drafter import DFlashDrafter, DrafterConfig
    from dflash.target_model.files import target_config
    from dflash.train.checkpoint import save_checkpoint

    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("export")
    target_dir = make_tiny_target(tmp, num_layers=4)
    tc = target_config(target_dir)
    cfg = DrafterConfig.from_target(tc, num_layers=LAYERS, block_size=B, target_layer_ids=[0, 2],
                                    mask_token_id=tc.vocab_size - 1)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    with torch.no_grad():  # non-trivial norms, so a swapped or missing norm weight shows in the logits
        for p in drafter.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    run_dir = tmp / "run"
    for step in (1, 2):  # the newest checkpoint is the one exported from a run directory
        ckpt = save_checkpoint(run_dir, step, drafter.state_dict() if step == 2 else {k: v * 0 for k, v in
                               drafter.state_dict().items()}, cfg.to_hf_dict(), {"step": step},
                               {"train": {"target": str(target_dir)}})
    return run_dir, ckpt, drafter.eval(), target_dir


def export(source, out, **kw):
    from dflash.config import ExportConfig
    from dflash.evaluate.export import run_export

    return run_export(ExportConfig(source=str(source), out=str(out), **kw))


def test_export_config_and_exact_key_set(run, tmp_path):
    run_dir, ckpt, drafter, _ = run
    out = tmp_path / "export"
    res = export(run_dir, out)
    assert res["checkpoint"] == str(ckpt)  # newest checkpoint of the run
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == B and cfg["num_target_layers"] == 4
    assert cfg["dflash_config"]["mask_token_id"] == drafter.config.mask_token_id
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 2]
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "rms_norm_eps", "vocab_size", "max_position_embeddings", "rope_theta"):
        assert cfg[k] == getattr(drafter.config, k), k
    assert cfg["num_hidden_layers"] == LAYERS and cfg["dtype"] == "bfloat16"

    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(LAYERS):
        p = f"layers.{i}."
        expected |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                     p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
        expected |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        expected |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == expected  # no embedding, no lm_head, no rotary buffer
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
        H = drafter.config.hidden_size
        assert tuple(f.get_tensor("fc.weight").shape) == (H, 2 * H)

    # transformers reads it as a Qwen3 config with the DFlash fields kept.
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(out)
    assert hf.model_type == "qwen3" and hf.dflash_config["target_layer_ids"] == [0, 2] and hf.block_size == B


def test_export_round_trip_logits(run, tmp_path):
    """fp32 export: identical logits; bf16 export: the rounded weights, exactly; --check passes."""
    from dflash.evaluate.export import _random_batch, load_export

    _, ckpt, drafter, _ = run
    head = torch.randn(drafter.config.vocab_size, drafter.config.hidden_size)
    batch = _random_batch(drafter.config, head, seed=3)
    with torch.no_grad():
        want = drafter(*batch) @ head.t()
    out32 = tmp_path / "fp32"
    export(ckpt, out32, dtype="fp32", check=True)
    with torch.no_grad():
        got = load_export(out32)(*batch) @ head.t()
    assert torch.equal(got, want)

    out16 = tmp_path / "bf16"
    res = export(ckpt, out16, check=True)
    assert res["check"]["ok"] and res["check"]["max_abs_logit_diff"] <= 1e-4
    with torch.no_grad():
        got16 = load_export(out16)(*batch) @ head.t()
    assert 0 < float((got16 - want).abs().max()) < 0.05 * float(want.abs().max())  # rounding only


def test_check_catches_a_broken_export(run, tmp_path):
    """Swap two same-shaped tensors in the export: the reload still succeeds, the check must fail."""
    from dflash.errors import DFlashError
    from dflash.evaluate.export import check_export

    _, ckpt, drafter, _ = run
    out = tmp_path / "export"
    export(ckpt, out, dtype="fp32")
    tensors = load_file(str(out / "model.safetensors"))
    a, b = "layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight"
    tensors[a], tensors[b] = tensors[b], tensors[a]
    save_file(tensors, str(out / "model.safetensors"))
    assert not check_export(out, drafter, torch.float32)["ok"]

    del tensors["norm.weight"]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(DFlashError, match="norm.weight"):
        check_export(out, drafter, torch.float32)


def test_export_command_line_and_errors(run, tmp_path):
    from dflash.errors import DFlashError

    run_dir, _, _, _ = run

    def dflash(*args):
        rc, out, err = invoke(args, command="export", cwd=tmp_path)
        return rc, out, " ".join(err.split())

    out = tmp_path / "served"
    rc, stdout, stderr = dflash(run_dir, out, "--check")
    assert rc == 0, stderr
    assert "check:" in stdout
    first = (out / "model.safetensors").read_bytes()

    # Re-exporting replaces the earlier export whole; no temporary directories are left behind.
    export(run_dir / "checkpoints" / "step-00000001", out)
    assert (out / "model.safetensors").read_bytes() != first
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []

    # Not a run or checkpoint: a one-paragraph error on the command line, nothing written.
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, _, stderr = dflash(empty, tmp_path / "x")
    assert rc == 1 and "run directory" in stderr and str(empty) in stderr
    assert not (tmp_path / "x").exists()
    with pytest.raises(DFlashError, match="does not exist"):
        export(tmp_path / "missing", tmp_path / "x")

    # An OUT that holds something else is left alone.
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(DFlashError, match="not an earlier dflash export"):
        export(run_dir, other)
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]
