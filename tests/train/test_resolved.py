"""The resolved run: preflight's result, frozen and picklable (what the launcher hands each process), and
under torchrun rank 0's, broadcast, its refusal raised on every rank."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch.multiprocessing as mp

from dflash.config import TrainConfig
from dflash.errors import ConfigError
from dflash.train.preflight import preflight
from dflash.train.resolved import ResolvedRun


def _cfg(tiny_store, out, **kw) -> TrainConfig:
    target, _, store = tiny_store
    base = dict(store=str(store), target=str(target), out=str(out), gpus="cpu:1", block_size=4, num_layers=1,
                steps=2, token_budget=256, num_anchors=4, num_workers=1, compile="off", seed=0, save_every=0)
    base.update(kw)
    return TrainConfig(**base)


def test_preflight_resolves_a_frozen_picklable_run(tiny_store, tmp_path):
    run = preflight(_cfg(tiny_store, tmp_path / "run"))
    assert isinstance(run, ResolvedRun)
    assert run.cfg.mask_token_id == run.mask_token_id == run.spec.mask_token_id == run.drafter_config.mask_token_id
    assert run.mask_token_source == "first unused embedding row"
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.mask_token_id = 0
    back = pickle.loads(pickle.dumps(run))
    assert back.record(2) == run.record(2) and back.spec == run.spec
    assert run.record(1)["store"]["samples"] == 24 and run.feature_width > 0


def test_labels_reach_the_loader(tiny_store, tmp_path):
    """--labels picks the loader's labels: the store's top-1 for target and rollout, the walk's reach for rollout."""
    specs = {lab: preflight(_cfg(tiny_store, tmp_path / lab, labels=lab)).spec for lab in ("data", "target", "rollout")}
    assert [(s.target_labels, s.rollout_labels) for s in specs.values()] == [(False, False), (True, False), (True, True)]


def test_the_init_record_is_replaced_not_edited(tiny_store, tmp_path):
    run = preflight(_cfg(tiny_store, tmp_path / "run", drafter_init="target", num_layers=2))
    applied = run.with_init_applied("fresh run")
    assert applied.record(1)["drafter_init"]["applied"] == "fresh run"
    assert "applied" not in run.record(1)["drafter_init"]
    assert preflight(_cfg(tiny_store, tmp_path / "plain")).with_init_applied("x").drafter_init is None


@pytest.mark.parametrize("labels", ["target", "rollout"])
def test_target_labels_need_a_store_with_topk(tiny_target, tmp_path, labels):
    """--labels target / rollout read the store's top-1: a store made with --topk 0 is refused, naming both ways out."""
    from helpers import build_store, make_conversations_jsonl

    data = make_conversations_jsonl(tmp_path / "chats.jsonl", 6)
    store = build_store(tmp_path / "store", tiny_target, data, topk=0, writer="thread")
    cfg = _cfg((tiny_target, data, store), tmp_path / "run", labels=labels)
    with pytest.raises(ConfigError, match=rf"--labels {labels} .* --topk 0; precompute with --topk K .* --labels data"):
        preflight(cfg)
    assert preflight(dataclasses.replace(cfg, labels="data")).spec.target_labels is False
    assert preflight(_cfg((tiny_target, data, store), tmp_path / "r2")).spec.kd is False


def _rank(rank: int, init: str, cfg: TrainConfig, out) -> None:
    import torch.distributed as dist

    from dflash.train.preflight import resolved_by_rank0

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        resolved_by_rank0(cfg, rank, 2)
        out.put((rank, "resolved"))
    except ConfigError as e:
        out.put((rank, str(e)))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_rank0_refusal_reaches_every_rank(tiny_store, tmp_path):
    cfg = _cfg(tiny_store, tmp_path / "run", num_layers=0)  # refused by preflight's option checks
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, f"file://{tmp_path / 'pg'}", cfg, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    assert got[0] == got[1] == "--num-layers must be at least 1."
