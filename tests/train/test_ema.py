"""`train --ema-decay` (dflash/train/ema.py): the average against its closed form, the swap in and out of the
drafter, and real runs whose checkpoints, export, held-out eval and resume carry the average."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash.config import TrainConfig
from dflash.drafter import DrafterConfig, build_drafter
from dflash.errors import ConfigError
from dflash.train.ema import WeightEMA


def _drafter(seed: int = 0):
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, intermediate_size=128, vocab_size=96, num_target_layers=4,
                        target_layer_ids=[1, 2], mask_token_id=95, block_size=8)
    d = build_drafter(cfg, context_scale=True)  # a buffer beside the parameters
    d.norm.weight.requires_grad_(False)  # a frozen parameter: not averaged
    return d


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _randomize(model, gen) -> None:
    """What an optimizer step does to the averaged parameters: new values, in place."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen))


def test_update_is_the_closed_form_average():
    d, gen, decay, k = _drafter(), torch.Generator().manual_seed(1), 0.8, 5
    frozen = d.norm.weight.detach().clone()
    history = [_weights(d)]
    ema = WeightEMA(d, decay)
    for _ in range(k):
        _randomize(d, gen)
        ema.update(d)
        history.append(_weights(d))
    assert "norm.weight" not in ema.names and len(ema.shadow) == sum(p.requires_grad for p in d.parameters())
    for name, e in zip(ema.names, ema.shadow):
        # e_k = d^k w_0 + sum_{j=1..k} (1-d) d^(k-j) w_j, in float64
        want = decay ** k * history[0][name].double() + sum(
            (1 - decay) * decay ** (k - j) * history[j][name].double() for j in range(1, k + 1))
        assert e.dtype == torch.float32
        assert torch.allclose(e.double(), want, rtol=1e-5, atol=1e-6), name
        assert not torch.allclose(e, history[-1][name], atol=1e-2), name  # the average is not the weights
    assert torch.equal(d.norm.weight, frozen)


def test_swapped_puts_the_average_in_and_the_trained_weights_back_exactly():
    d, gen = _drafter(), torch.Generator().manual_seed(2)
    ema = WeightEMA(d, 0.9)
    _randomize(d, gen)
    ema.update(d)
    trained, params = _weights(d), {n: p for n, p in d.named_parameters()}
    ids = {n: id(p) for n, p in params.items()}
    with ema.swapped(d):
        for name, e in zip(ema.names, ema.shadow):
            assert torch.equal(params[name], e), name
            assert not torch.equal(params[name], trained[name]), name
    assert all(torch.equal(p, trained[n]) for n, p in d.named_parameters())
    with pytest.raises(RuntimeError, match="inside"), ema.swapped(d):
        raise RuntimeError("inside")
    assert all(torch.equal(p, trained[n]) for n, p in d.named_parameters())
    assert {n: id(p) for n, p in d.named_parameters()} == ids  # the same Parameter objects (compiled graphs keep)


def test_state_dict_round_trip_leaves_the_weights_alone():
    d, gen = _drafter(), torch.Generator().manual_seed(3)
    ema = WeightEMA(d, 0.9)
    for _ in range(3):
        _randomize(d, gen)
        ema.update(d)
    state = ema.state_dict(d)
    assert "context_scale" in state and torch.equal(state["context_scale"], d.context_scale)
    for name, e in zip(ema.names, ema.shadow):
        assert torch.equal(state[name], e), name
    other = _drafter(seed=7)
    before = _weights(other)
    again = WeightEMA(other, 0.9)
    again.load_state_dict(other, state)
    assert all(torch.equal(p, before[n]) for n, p in other.named_parameters())
    assert again.names == ema.names and all(torch.equal(a, b) for a, b in zip(again.shadow, ema.shadow))


def test_decay_is_checked_and_off_by_default(tmp_path):
    from dflash.fields import check_rules
    from processes import invoke

    assert TrainConfig().optim.ema_decay == 0.0
    check_rules(TrainConfig(ema_decay=0.999).optim.rules())
    for bad in (1.0, -0.1, 1.5):
        with pytest.raises(ConfigError, match=r"--ema-decay .* is outside \[0, 1\)"):
            check_rules(TrainConfig(ema_decay=bad).optim.rules())
    rc, _, err = invoke(["--store", "s", "--target", "t", "--out", "o", "--ema-decay", "1"], command="train",
                        cwd=tmp_path)
    assert rc == 1 and "--ema-decay 1.0 is outside [0, 1)" in err, err
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------------- real runs

N = 24  # steps of the real runs: enough that the average and the trained drafter predict differently


@pytest.fixture(scope="module")
def counting(counting_store):
    return counting_store


def _cfg(target, store, out, **kw):
    base = dict(store=str(store), target=str(target), out=str(out), gpus="cpu:1", block_size=8, num_layers=1,
                steps=N, lr=1e-2, warmup_steps=2, token_budget=512, num_anchors=16, num_workers=1,
                compile="off", seed=0, save_every=1, keep_checkpoints=0)
    base.update(kw)
    return TrainConfig(**base)


def _ckpt(run, step: int) -> Path:
    return Path(run) / "checkpoints" / f"step-{step:08d}"


def _trained(run, step: int) -> dict[str, torch.Tensor]:
    return torch.load(_ckpt(run, step) / "train_state.pt", weights_only=True)["trained_model"]


def _saved(run, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(_ckpt(run, step) / "model.safetensors"))


def _initial(run, seed: int) -> dict[str, torch.Tensor]:
    """The run's step-0 weights, built again as build_model builds them (the seed, then the drafter)."""
    from dflash.drafter import config_from_hf_dict

    config = config_from_hf_dict(json.loads((_ckpt(run, 1) / "config.json").read_text()))
    torch.manual_seed(seed)
    return {n: p.detach() for n, p in build_drafter(config).named_parameters()}


def _closed_form(w0: dict, trained: list[dict], decay: float) -> dict[str, torch.Tensor]:
    k = len(trained)
    return {n: decay ** k * w0[n].double() + sum((1 - decay) * decay ** (k - j) * trained[j - 1][n].double()
                                                 for j in range(1, k + 1)) for n in w0}


def _assert_close(a: dict, b: dict, keys, exact: bool = False):
    for k in keys:
        ok = torch.equal(a[k], b[k]) if exact else torch.allclose(a[k].double(), b[k].double(), rtol=1e-5, atol=1e-6)
        assert ok, k


@pytest.fixture(scope="module")
def runs(counting, tmp_path_factory):
    """The same N steps with --ema-decay 0.9 (a held-out eval at the end) and without, checkpoints at every step."""
    from dflash.train.launch import launch_train

    target, store = counting
    tmp = tmp_path_factory.mktemp("ema_runs")
    ema = _cfg(target, store, tmp / "ema", ema_decay=0.9, eval_every=N, eval_store=str(store))
    plain = _cfg(target, store, tmp / "plain")
    launch_train(ema)
    launch_train(plain)
    return ema, plain


@pytest.mark.slow
def test_checkpoints_and_export_hold_the_average_of_the_trained_weights(runs, tmp_path):
    from dflash.config import ExportConfig
    from dflash.drafter import export_keys
    from dflash.evaluate.export import load_training_drafter, run_export

    ema, plain = runs
    names = list(_trained(ema.out, N))
    # the average changes nothing of the training: its trained weights are the plain run's, step by step
    for step in range(1, N + 1):
        _assert_close(_trained(ema.out, step), _saved(plain.out, step), names, exact=True)
        assert "trained_model" not in torch.load(_ckpt(plain.out, step) / "train_state.pt", weights_only=True)
    w0 = _initial(ema.out, ema.seed)
    trained = [_trained(ema.out, s) for s in range(1, N + 1)]
    want = _closed_form(w0, trained, 0.9)
    for step in (1, N // 2, N):
        _assert_close(_saved(ema.out, step), _closed_form(w0, trained[:step], 0.9), names)
    # ... which is far from the trained weights (a checkpoint of those would fail the comparisons above)
    assert max(float((want[n] - trained[-1][n].double()).abs().max()) for n in names) > 1e-3
    out = tmp_path / "export"
    run_export(ExportConfig(source=ema.out, out=str(out), dtype="fp32"))
    exported = load_file(str(out / "model.safetensors"))
    assert sorted(exported) == sorted(export_keys(load_training_drafter(ema.out)[0].config))
    _assert_close(exported, want, list(exported))


@pytest.mark.slow
def test_accumulation_updates_the_average_once_per_optimizer_step(counting, tmp_path):
    from dflash.train.launch import launch_train

    target, store = counting
    cfg = _cfg(target, store, tmp_path / "run", steps=3, grad_accum=3, ema_decay=0.5)
    launch_train(cfg)
    w0 = _initial(cfg.out, cfg.seed)
    trained = [_trained(cfg.out, s) for s in range(1, 4)]
    _assert_close(_saved(cfg.out, 3), _closed_form(w0, trained, 0.5), list(w0))


@pytest.mark.slow
def test_heldout_eval_measures_the_average(runs, tmp_path):
    """metrics' eval at the last step is offline tau of the checkpoint's (averaged) drafter, not of the trained one."""
    import dataclasses

    from dflash.evaluate.export import load_training_drafter
    from dflash.store import open_store
    from dflash.train.heldout import offline_tau
    from dflash.train.preflight import preflight

    ema, _ = runs
    rec = [json.loads(x) for x in (Path(ema.out) / "metrics.jsonl").read_text().splitlines()][-1]
    assert rec["step"] == N and "eval_tau" in rec
    resolved = preflight(dataclasses.replace(ema, out=str(tmp_path / "unused")))
    embed, head = resolved.embed_and_head(torch.device("cpu"))
    spec, store = resolved.spec, open_store(ema.eval_store, require_complete=True)

    def measured(drafter) -> dict:  # as the trainer's eval calls it
        return offline_tau(drafter, embed, head, store, num_anchors=ema.num_anchors, seed=ema.seed,
                           token_budget=spec.token_budget, block_budget=spec.block_budget,
                           num_shapes=spec.num_shapes, progress=False)

    averaged = load_training_drafter(_ckpt(ema.out, N))[0]
    trained = build_drafter(averaged.config).float().eval()
    trained.load_state_dict(_trained(ema.out, N), strict=False)
    got, other = measured(averaged), measured(trained)
    assert rec["eval_tau"] == pytest.approx(got["tau"], rel=1e-9)
    assert rec["eval_acc"] == pytest.approx(got["accuracy"], rel=1e-9)
    assert other["accuracy"] != pytest.approx(got["accuracy"], rel=1e-9)  # so the checks above can fail


@pytest.mark.slow
def test_resume_reproduces_the_average(runs, counting, tmp_path, capsys):
    """N/2 steps, then a resume to N, end with the straight run's average and weights; a checkpoint written
    without an average starts one from its weights (a warning), one with an average resumed without
    --ema-decay trains on from the trained weights."""
    from dflash.train.launch import launch_train

    ema, plain = runs
    target, store = counting
    names = list(_trained(ema.out, N))

    def resumed_from(src, step: int, name: str, **kw) -> Path:
        run = tmp_path / name
        shutil.copytree(src, run)
        for later in range(step + 1, N + 1):
            shutil.rmtree(_ckpt(run, later))
        launch_train(_cfg(target, store, run, resume=True, **kw))
        return run

    run = resumed_from(ema.out, N // 2, "ema", ema_decay=0.9, eval_every=N, eval_store=str(store))
    _assert_close(_saved(run, N), _saved(ema.out, N), names, exact=True)
    _assert_close(_trained(run, N), _trained(ema.out, N), names, exact=True)

    capsys.readouterr()
    run = resumed_from(plain.out, N // 2, "old", ema_decay=0.9)
    assert "holds no weight average; --ema-decay 0.9 starts it from the checkpoint's weights" in capsys.readouterr().err
    trained = [_trained(run, s) for s in range(N // 2 + 1, N + 1)]
    _assert_close(_closed_form(_saved(plain.out, N // 2), trained, 0.9), _saved(run, N), names)

    run = resumed_from(ema.out, N // 2, "off")
    assert "holds a weight average" in capsys.readouterr().err
    _assert_close(_saved(run, N), _saved(plain.out, N), names, exact=True)
