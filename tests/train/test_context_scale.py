"""`train --context-scale rms` (dflash/train/context_scale.py): the factors measured from a real store, the
drafter's buffer, its fold into fc.weight at export (every variant), and a real run that trains, resumes,
exports and refuses a changed setting."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash.config import TrainConfig
from dflash.drafter import ARCHS, DrafterConfig, build_drafter, export_keys, with_arch
from dflash.errors import ConfigError


def _cfg(arch: str = "dflash"):
    base = DrafterConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, intermediate_size=128, vocab_size=96, num_target_layers=4,
                         target_layer_ids=[1, 2], mask_token_id=95, block_size=8)
    return with_arch(base, arch)


def _scaled_drafter(arch: str, seed: int = 0):
    """A drafter with a context_scale buffer of widely spread (not power-of-two) factors and non-trivial norms."""
    torch.manual_seed(seed)
    d = build_drafter(_cfg(arch), context_scale=True)
    with torch.no_grad():
        d.context_scale.copy_(torch.exp(4 * torch.randn(d.context_scale.shape)))  # factors ~ e^-8 .. e^8
        for p in d.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return d.eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_the_export_folds_the_scale_and_computes_the_same(arch, tmp_path):
    from dflash.evaluate.export import _random_batch, check_export, export_drafter, load_export

    torch.set_num_threads(1)
    scaled = _scaled_drafter(arch)
    out = export_drafter(scaled, tmp_path / "export", torch.float32)
    tensors = load_file(str(out / "model.safetensors"))
    assert sorted(tensors) == sorted(export_keys(scaled.config))  # no context_scale in the export
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (export_drafter(build_drafter(scaled.config), tmp_path / "plain", torch.float32) / "config.json").read_text())
    assert torch.allclose(tensors["fc.weight"], scaled.fc.weight * scaled.context_scale[None, :])

    plain = load_export(out, torch.float32)  # strict load into a drafter without the buffer
    assert plain.context_scale is None and "context_scale" not in plain.state_dict()
    batch = _random_batch(scaled.config, None)
    lm_head = torch.randn(scaled.config.vocab_size, scaled.config.hidden_size)
    with torch.no_grad():
        h_scaled, h_plain = scaled(*batch), plain(*batch)
        assert torch.allclose(h_plain, h_scaled, rtol=1e-5, atol=1e-5)
        assert torch.allclose(h_plain @ lm_head.t(), h_scaled @ lm_head.t(), rtol=1e-5, atol=1e-4)
        # the same weights without the fold compute something else (so the comparison above can fail)
        unfolded = type(scaled)(scaled.config)
        unfolded.load_state_dict({k: v for k, v in scaled.state_dict().items() if k != "context_scale"}, strict=False)
        assert not torch.allclose(unfolded.eval()(*batch), h_scaled, rtol=1e-3, atol=1e-3)
        # the decoding path (_context through forward_step) agrees too
        ctx, embeds, ctx_pos, _, _ = batch
        B = scaled.config.block_size
        step = [ctx[:, :20], embeds[:, :B], ctx_pos[:, :20], torch.arange(20, 20 + B).view(1, -1)]
        a, b = scaled.forward_step(*step, scaled.new_cache()), plain.forward_step(*step, plain.new_cache())
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    assert check_export(out, scaled, torch.float32, lm_head)["ok"]
    # an export that forgot the fold fails the check against the scaled checkpoint's model
    forgot = export_drafter(unfolded, tmp_path / "forgot", torch.float32)
    assert not check_export(forgot, scaled, torch.float32, lm_head)["ok"]


@pytest.mark.parametrize("arch", ARCHS)
def test_default_none_has_no_buffer_and_the_keys_of_today(arch):
    assert TrainConfig().drafter.context_scale == "none"
    d = build_drafter(_cfg(arch))
    assert d.context_scale is None
    assert not any("context_scale" in name for name, _ in d.named_buffers())
    assert sorted(d.state_dict()) == sorted(export_keys(d.config))
    # with the option the one extra key is the buffer, and the draws of the weights are the same
    torch.manual_seed(3)
    a = build_drafter(_cfg(arch), context_scale=True)
    torch.manual_seed(3)
    b = build_drafter(_cfg(arch))
    assert sorted(a.state_dict()) == sorted([*export_keys(a.config), "context_scale"])
    assert all(torch.equal(v, a.state_dict()[k]) for k, v in b.state_dict().items())
    assert torch.equal(a.context_scale, torch.ones(a.fc.in_features))


def test_the_scale_is_the_rms_of_the_stores_first_tokens(tiny_store):
    from dflash.store import open_store
    from dflash.train import context_scale as cs

    store = open_store(tiny_store[2], require_complete=True)
    rows = [store.read(sid, fields=("hidden",))["hidden"].double() for sid in store.sample_ids()]
    every = torch.cat([r[1:] for r in rows])  # position 0 of each sample left out
    n = len(every) // 2 + 3  # stops inside a sample
    rms, tokens, samples = cs.context_rms(store, max_tokens=n)
    brute = every[:n].pow(2).mean(0).sqrt()
    assert tokens == n and samples < len(rows)
    assert torch.allclose(rms, brute, rtol=1e-10, atol=0)
    # with position 0 the RMS would differ: the skip is real
    with_sinks = torch.cat(rows)[:n].pow(2).mean(0).sqrt()
    assert not torch.allclose(rms, with_sinks, rtol=1e-6, atol=0)

    scale = cs.scale_from_rms(rms, store.num_layers)
    assert scale.dtype == torch.float32 and scale.shape == (store.hidden_size * store.num_layers,)
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)  # powers of two
    ratio = scale.double() * brute
    assert (ratio >= 2 ** -0.5 - 1e-9).all() and (ratio <= 2 ** 0.5 + 1e-9).all()  # within sqrt(2) of 1/rms
    full = cs.compute(store)
    assert torch.equal(full["scale"], cs.scale_from_rms(cs.context_rms(store)[0], store.num_layers))
    assert full["record"]["tokens"] == min(cs.MAX_TOKENS, len(every))


def test_a_dead_channel_is_floored_at_its_layers_median():
    from dflash.train.context_scale import FLOOR, scale_from_rms

    rms = torch.tensor([1.0, 1.0, 1.0, 0.0, 8.0, 8.0, 8.0, 1e-9], dtype=torch.float64)  # two layers of 4
    scale = scale_from_rms(rms, 2)
    assert scale[:3].tolist() == [1.0, 1.0, 1.0] and scale[4:7].tolist() == [0.125] * 3
    assert scale[3] == 2.0 ** round(-torch.log2(torch.tensor(FLOOR)).item())  # 1 / (0.01 x median 1)
    assert scale[7] == 2.0 ** round(-torch.log2(torch.tensor(8 * FLOOR)).item())


def _train_cfg(target, store, out, **kw):
    base = dict(store=str(store), target=str(target), out=str(out), gpus="cpu:1", block_size=8, num_layers=1,
                steps=2, lr=3e-3, warmup_steps=1, token_budget=256, num_anchors=8, num_workers=1, compile="off",
                seed=0, save_every=2, context_scale="rms")
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.slow
def test_a_run_trains_resumes_exports_and_refuses_a_change(tiny_store, tmp_path):
    from dflash.config import ExportConfig
    from dflash.evaluate.export import load_training_drafter, run_export
    from dflash.store import open_store
    from dflash.train import context_scale as cs
    from dflash.train.launch import launch_train
    from dflash.train.preflight import preflight

    target, _, store = tiny_store
    run = tmp_path / "run"
    launch_train(_train_cfg(target, store, run, steps=4))
    want = cs.compute(open_store(store))["scale"]
    first = load_file(str(run / "checkpoints" / "step-00000002" / "model.safetensors"))
    assert torch.equal(first["context_scale"], want)
    record = json.loads((run / "config.json").read_text())["context_scale"]
    assert record["mode"] == "rms" and record["tokens"] > 0
    ref = load_file(str(run / "checkpoints" / "step-00000004" / "model.safetensors"))

    # back to step 2, then on to step 4: the buffer comes from the checkpoint (preflight measures nothing)
    shutil.rmtree(run / "checkpoints" / "step-00000004")
    assert preflight(_train_cfg(target, store, run, steps=4, resume=True)).context_scale is None
    launch_train(_train_cfg(target, store, run, steps=4, resume=True))
    resumed = load_file(str(run / "checkpoints" / "step-00000004" / "model.safetensors"))
    assert resumed.keys() == ref.keys()
    for k in ref:
        assert torch.equal(resumed[k], ref[k]), k  # exact resume, the buffer included

    # eval's loader keeps the buffer; export folds it and --check passes
    drafter, _, _ = load_training_drafter(run)
    assert torch.equal(drafter.context_scale, want)
    res = run_export(ExportConfig(source=str(run), out=str(tmp_path / "export"), check=True, dtype="bf16"))
    assert res["check"]["ok"] and res["check"]["max_abs_logit_diff"] == 0.0  # power-of-two factors: exact in bf16
    assert "context_scale" not in load_file(str(tmp_path / "export" / "model.safetensors"))

    with pytest.raises(ConfigError, match=r"trained with --context-scale rms and this run asks for --context-scale "
                                          r"none.*resume with --context-scale rms"):
        launch_train(_train_cfg(target, store, run, steps=6, resume=True, context_scale="none"))
    plain = tmp_path / "plain"
    launch_train(_train_cfg(target, store, plain, context_scale="none"))
    assert "context_scale" not in load_file(str(plain / "checkpoints" / "step-00000002" / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"trained with --context-scale none and this run asks for --context-scale rms"):
        launch_train(_train_cfg(target, store, plain, steps=4, resume=True))


@pytest.fixture(scope="module")
def one_process_accumulating(tiny_store, tmp_path_factory):
    """cpu:1 x 2 micro-batches, 3 steps: the reference both two-process runs (DDP, FSDP2) must equal, trained
    once for the module (the run does not depend on the two-process run's parallelism)."""
    from dflash.train.launch import launch_train

    target, _, store = tiny_store
    one = _train_cfg(target, store, tmp_path_factory.mktemp("context_scale") / "one", steps=3, save_every=3,
                     grad_accum=2)
    launch_train(one)
    return Path(one.out)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_set_the_scale_on_every_rank(tiny_store, tmp_path, parallel, one_process_accumulating):
    """cpu:2 (DDP or FSDP2 over gloo) x 1 micro-batch = cpu:1 x 2 micro-batches, step for step: a rank left at
    ones would compute other losses and gradients."""
    from dflash.train.launch import launch_train

    target, _, store = tiny_store
    two = _train_cfg(target, store, tmp_path / "two", gpus="cpu:2", steps=3, save_every=3, parallel=parallel)
    launch_train(two)  # launched from this process: its two training processes are spawned as from the CLI
    one = one_process_accumulating

    def losses(run):
        return [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]

    assert len(losses(tmp_path / "two")) == 3
    assert losses(tmp_path / "two") == pytest.approx(losses(one), rel=1e-5)
    w2 = load_file(str(tmp_path / "two" / "checkpoints" / "step-00000003" / "model.safetensors"))
    w1 = load_file(str(one / "checkpoints" / "step-00000003" / "model.safetensors"))
    assert torch.equal(w2["context_scale"], w1["context_scale"]) and not torch.equal(
        w1["context_scale"], torch.ones_like(w1["context_scale"]))
    for k in w1:
        assert torch.allclose(w1[k], w2[k], atol=1e-5, rtol=1e-4), k
