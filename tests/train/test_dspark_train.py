"""`dflash train --arch dspark` end to end on CPU: a real store with final hidden states, the refusals (no final
hidden state, another arch on resume), and the top-k variant on a store without them (docs/DESIGN.md §12)."""

from __future__ import annotations

import json
import math

import pytest
from safetensors import safe_open

from dflash.config import TrainConfig
from dflash.errors import ConfigError, StoreError
from dflash.train.launch import launch_train

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    from train_fixtures import build_counting_store

    tmp = tmp_path_factory.mktemp("dspark")
    target, with_final = build_counting_store(tmp / "final", n=16, teach=False, final_hidden=True)
    _, plain = build_counting_store(tmp / "plain", n=16, teach=False)
    return target, with_final, plain


def _base(target, store, out, **kw):
    base = dict(store=str(store), target=str(target), out=str(out), gpus="cpu:1", block_size=8, num_layers=1,
                steps=3, lr=3e-3, warmup_steps=1, token_budget=256, num_anchors=8, num_workers=1, compile="off",
                seed=0, save_every=0, arch="dspark", markov_rank=8)
    base.update(kw)
    return base


def test_dspark_trains_on_final_hidden_and_resume_refuses_another_arch(stores, tmp_path):
    target, store, _ = stores
    base = _base(target, store, tmp_path / "run")
    final = launch_train(TrainConfig(**base))
    assert final["steps"] == 3 and math.isfinite(final["loss"]) and 1.0 <= final["tau"] <= 8
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    r = rows[-1]
    assert r["tv"] > 0 and r["confidence_bce"] > 0 and r["ce"] > 0
    assert math.isclose(r["loss"], 0.1 * r["ce"] + 0.9 * r["tv"] + r["confidence_bce"], rel_tol=1e-6)
    ckpt = sorted((tmp_path / "run" / "checkpoints").iterdir())[-1]
    saved = json.loads((ckpt / "config.json").read_text())
    assert saved["architectures"] == ["Qwen3DSparkModel"] and saved["markov_rank"] == 8
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
            "confidence_head.proj.bias"} <= keys
    with pytest.raises(ConfigError, match="dspark drafter and this run asks for --arch dflash"):
        launch_train(TrainConfig(**dict(base, arch="dflash", steps=4, resume=True)))
    with pytest.raises(ConfigError, match="markov_rank"):
        launch_train(TrainConfig(**dict(base, markov_rank=16, steps=4, resume=True)))
    resumed = launch_train(TrainConfig(**dict(base, steps=4, resume=True)))
    assert resumed["steps"] == 4


def test_a_store_without_final_hidden_is_refused_naming_the_option(stores, tmp_path):
    target, _, plain = stores
    with pytest.raises(StoreError) as e:
        launch_train(TrainConfig(**_base(target, plain, tmp_path / "run")))
    msg = str(e.value)
    assert "--final-hidden" in msg and "--tv-source topk" in msg and str(plain) in msg and "\n" not in msg
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_topk_variant_trains_on_a_store_without_final_hidden(stores, tmp_path):
    target, _, plain = stores
    final = launch_train(TrainConfig(**_base(target, plain, tmp_path / "run", tv_source="topk",
                                             enable_confidence_head=False, confidence_head_with_markov=False)))
    assert final["steps"] == 3 and math.isfinite(final["loss"])
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["tv"] > 0 and rows[-1]["confidence_bce"] == 0


def test_kd_with_dspark_is_refused(stores, tmp_path):
    target, store, _ = stores
    with pytest.raises(ConfigError, match="--kd-weight 0"):
        launch_train(TrainConfig(**_base(target, store, tmp_path / "run", kd_weight=0.5)))
