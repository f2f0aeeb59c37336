"""What vLLM and SGLang read from an export (docs/DESIGN.md §2, §6, §9): layer types and window,
eagle_aux_hidden_state_layer_ids, refusals of drafters they could not serve (at export and at train
start), file modes, no paths of this machine; and a sliding-window drafter trained through the command line,
resumed, refused on a changed choice, exported and checked.

Engine code read (search corpus `code`): vllm `vllm/model_executor/models/qwen3_dflash.py`
(`_resolve_layer_attention`: `layer_types[i] == "sliding_attention"` makes a layer causal with
`sliding_window`), vllm `vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`
(`eagle_aux_hidden_state_layer_ids` read before `dflash_config.target_layer_ids` + 1), SGLang
`python/sglang/srt/models/dflash.py` and `speculative/dflash_utils.py` (sliding layers: DECODER attention
with window_left = sliding_window - 1).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dflash.errors import ConfigError
from processes import invoke


def _drafter(target_dir, ids, layer_types=None, window=None, num_layers=2, B=8):
    from dflash.drafter import DFlashDrafter, DrafterConfig
    from dflash.target_model.files import target_config

    tc = target_config(target_dir)
    cfg = DrafterConfig.from_target(tc, num_layers=num_layers, block_size=B, target_layer_ids=ids,
                                    mask_token_id=tc.vocab_size - 1, layer_types=layer_types, sliding_window=window)
    torch.manual_seed(0)
    return DFlashDrafter(cfg).eval()


def _checkpoint(tmp, target_dir, drafter):
    from dflash.train.checkpoint import save_checkpoint

    return save_checkpoint(tmp / "run", 1, drafter.state_dict(), drafter.config.to_hf_dict(), {"step": 1},
                           {"train": {"target": str(Path(target_dir).resolve())}})


def _export(source, out, **kw):
    from dflash.config import ExportConfig
    from dflash.evaluate.export import run_export

    return run_export(ExportConfig(source=str(source), out=str(out), **kw))


def _strings(x):
    if isinstance(x, dict):
        for k, v in x.items():
            yield str(k)
            yield from _strings(v)
    elif isinstance(x, list):
        for v in x:
            yield from _strings(v)
    elif isinstance(x, str):
        yield x


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from helpers import make_tiny_target

    return make_tiny_target(tmp_path_factory.mktemp("engines"), num_layers=4)


def test_sliding_export_config_eagle_ids_modes_and_no_paths(target, tmp_path):
    from dflash.drafter import DrafterConfig

    drafter = _drafter(target, [0, 2], ["sliding", "full"], 24)
    ckpt = _checkpoint(tmp_path, target, drafter)
    # A path of this machine carried in the drafter config (as transformers' _name_or_path would be).
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["_name_or_path"] = str(tmp_path.resolve() / "somewhere")
    cfg["origin_dir"] = str(tmp_path.resolve())
    (ckpt / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "export"
    res = _export(tmp_path / "run", out, check=True)
    assert res["check"]["ok"] and res["check"]["config_round_trip"]
    hf = json.loads((out / "config.json").read_text())
    assert hf["layer_types"] == ["sliding_attention", "full_attention"]
    assert hf["sliding_window"] == 24 and hf["use_sliding_window"] is True
    assert hf["eagle_aux_hidden_state_layer_ids"] == [1, 3]  # the stream entering layer i + 1
    assert hf["dflash_config"]["target_layer_ids"] == [0, 2]
    assert "causal" not in hf["dflash_config"] and "use_swa" not in hf["dflash_config"]  # per-layer types decide
    back = DrafterConfig.from_hf_dict(hf)
    assert back.layer_types == ["sliding_attention", "full_attention"] and back.sliding_window == 24
    assert "eagle_aux_hidden_state_layer_ids" not in back.extra
    # Readable by other users: safetensors writes 0600.
    for f in ("config.json", "model.safetensors"):
        assert (out / f).stat().st_mode & 0o777 == 0o644, f
    # No absolute path of this machine, in config.json or in the safetensors metadata.
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        meta = f.metadata() or {}
    here = [str(tmp_path.resolve()), str(Path(target).resolve()), str(Path.home())]
    for s in list(_strings(hf)) + list(_strings(meta)):
        assert not s.startswith(("/", "~")), s
        assert not any(h in s for h in here), s


def test_full_drafter_export_keeps_its_fields(target, tmp_path):
    drafter = _drafter(target, [1, 2])
    _export(_checkpoint(tmp_path, target, drafter), tmp_path / "export")
    hf = json.loads((tmp_path / "export" / "config.json").read_text())
    assert hf["layer_types"] == ["full_attention"] * 2
    assert hf["use_sliding_window"] is False and hf["sliding_window"] is None
    assert hf["eagle_aux_hidden_state_layer_ids"] == [2, 3]


@pytest.mark.parametrize("ids,match,suggest", [([1, 3], "last layer 3", "--target-layers 0,2"),
                                               ([2, 0], "ascending order", "--target-layers 0,2")])
def test_export_refuses_what_the_engines_cannot_serve(target, tmp_path, ids, match, suggest):
    ckpt = _checkpoint(tmp_path, target, _drafter(target, ids))
    with pytest.raises(ConfigError, match=match) as e:
        _export(ckpt, tmp_path / "export")
    assert suggest in str(e.value)
    assert ("i + 1" in str(e.value)) == ("last" in match)  # says why: the stream entering layer i + 1
    assert not (tmp_path / "export").exists()


@pytest.mark.slow
def test_export_refusal_on_the_command_line(target, tmp_path):
    ckpt = _checkpoint(tmp_path, target, _drafter(target, [1, 3]))
    match = "last layer 3"
    rc, _, err = invoke([ckpt, tmp_path / "export"], command="export", cwd=tmp_path)
    assert rc == 1 and match in err and not (tmp_path / "export").exists()


def test_export_refuses_inconsistent_eagle_ids(target, tmp_path):
    from dflash.errors import DFlashError
    from dflash.evaluate.export import load_export

    out = tmp_path / "export"
    _export(_checkpoint(tmp_path, target, _drafter(target, [0, 2])), out)
    load_export(out)
    hf = json.loads((out / "config.json").read_text())
    hf["eagle_aux_hidden_state_layer_ids"] = [0, 2]
    (out / "config.json").write_text(json.dumps(hf))
    with pytest.raises(DFlashError, match="eagle_aux_hidden_state_layer_ids"):
        load_export(out)


def _train_cfg(target, store, out, **kw):
    from dflash.config import TrainConfig

    base = dict(store=str(store), target=str(target), out=str(out), gpus="cpu:1", block_size=8, num_layers=2,
                steps=2, token_budget=256, num_anchors=8, num_workers=1, compile="off")
    return TrainConfig(**{**base, **kw})


def test_train_start_refuses_bad_layer_choices(tiny_store, tmp_path):
    from dflash.train.preflight import preflight

    target, data, store = tiny_store
    for kw, match in ((dict(layer_types=["sliding", "full"]), "--sliding-window"),
                      (dict(layer_types=["sliding"]), "each of the 2 drafter layers"),
                      (dict(layer_types=["local", "full"], sliding_window=8), "full or sliding"),
                      (dict(sliding_window=8), "without a sliding layer")):
        with pytest.raises(ConfigError, match=match):
            preflight(_train_cfg(target, store, tmp_path / "run", **kw))
    setup = preflight(_train_cfg(target, store, tmp_path / "run", layer_types=["sliding", "full"], sliding_window=8))
    assert setup.drafter_config.layer_types == ["sliding_attention", "full_attention"]
    assert setup.spec.sliding_window == 8
    assert preflight(_train_cfg(target, store, tmp_path / "run")).spec.sliding_window is None
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_train_start_refuses_layers_the_engines_cannot_serve(tiny_store, tmp_path, monkeypatch):
    import dflash.precompute.run as precompute_run
    from dflash.train.preflight import preflight
    from helpers import build_store

    target, data, _ = tiny_store
    # precompute refuses these layers itself now; a store made before it did still reaches train
    monkeypatch.setattr(precompute_run, "engine_layer_problem", lambda ids, n: None)
    for ids, match in (([1, 3], "last layer 3"), ([2, 1], "ascending order")):
        s = build_store(tmp_path / f"store-{ids[0]}{ids[1]}", target, data, target_layers=ids, max_samples=4, topk=0,
                        writer="thread")
        with pytest.raises(ConfigError, match=match):
            preflight(_train_cfg(target, s, tmp_path / "run"))
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_sliding_training_through_the_cli_resume_export_check(tiny_store, tmp_path):
    """`dflash train --layer-types sliding,full --sliding-window 12` on CPU: trains, checkpoints the
    choice, refuses to resume with another window, offline tau on the same loader, export --check."""
    target, _, store = tiny_store
    run = tmp_path / "run"
    args = ["train", "--store", str(store), "--target", str(target), "--out", str(run), "--gpus", "cpu:1",
            "--block-size", "8", "--num-layers", "2", "--layer-types", "sliding,full", "--sliding-window", "12",
            "--token-budget", "256", "--num-anchors", "8", "--num-workers", "1", "--compile", "off",
            "--warmup-steps", "1", "--eval-every", "2", "--eval-store", str(store)]
    rc, _, err = invoke(args[1:] + ["--steps", "2"], command="train", cwd=tmp_path)
    assert rc == 0, err[-3000:]
    record = json.loads((run / "config.json").read_text())
    assert record["drafter"]["layer_types"] == ["sliding_attention", "full_attention"]
    assert record["drafter"]["sliding_window"] == 12
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_tau" in m for m in metrics)  # held-out tau ran through the sliding masks
    # A changed choice is refused on resume; the same one continues.
    changed = [a if a != "12" else "16" for a in args]
    rc, _, err = invoke(changed[1:] + ["--steps", "3", "--resume"], command="train", cwd=tmp_path)
    assert rc == 1 and "different drafter" in err
    rc, _, err = invoke(args[1:] + ["--steps", "3", "--resume"], command="train", cwd=tmp_path)
    assert rc == 0, err[-3000:]
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    rc, out, err = invoke([run, tmp_path / "export", "--check"], command="export", cwd=tmp_path)
    assert rc == 0 and "round trip ok" in out, err
    hf = json.loads((tmp_path / "export" / "config.json").read_text())
    assert hf["layer_types"] == ["sliding_attention", "full_attention"] and hf["sliding_window"] == 12
    assert hf["eagle_aux_hidden_state_layer_ids"] == [2, 3]
