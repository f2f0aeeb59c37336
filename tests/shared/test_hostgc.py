"""dflash.hostgc: garbage collection on the loop's schedule, measured, and restored afterwards."""

import gc

import pytest

from dflash import hostgc


def _cycles(n=2000):
    for _ in range(n):
        a = []
        a.append(a)  # unreachable once the loop moves on: only the cyclic collector frees it


def test_timer_counts_every_collection():
    with hostgc.GcTimer() as t:
        gc.collect()
        gc.collect(0)
    assert t.collections == 2 and t.total_s > 0
    before = t.collections
    gc.collect()
    assert t.collections == before  # closed: no longer counting


def test_step_gc_freezes_after_warm_up_collects_on_schedule_and_restores():
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with hostgc.StepGC(every=3) as sg:
        assert not gc.isenabled()  # no automatic collection at some random step
        sg.after_step(1, warming_up=True)
        assert gc.get_freeze_count() == 0
        sg.after_step(2, warming_up=False)  # past warm-up: set-up's objects are frozen
        assert gc.get_freeze_count() > 0
        n = sg.timer.collections
        _cycles()
        sg.after_step(4, warming_up=False)
        assert sg.timer.collections == n  # not a multiple of 3
        sg.after_step(6, warming_up=False)
        assert sg.timer.collections == n + 1
        assert gc.get_count()[0] < 100  # the young generation was just collected
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_every_zero_leaves_python_in_charge():
    with hostgc.StepGC(every=0) as sg:
        assert gc.isenabled()
        sg.after_step(2, warming_up=False)
        sg.full()
        assert gc.get_freeze_count() == 0
    assert gc.isenabled()


@pytest.mark.slow
def test_training_collects_on_schedule_and_restores_gc(tmp_path):
    from dflash.config import TrainConfig
    from dflash.train.launch import launch_train
    from train_fixtures import build_counting_store

    target, store = build_counting_store(tmp_path / "data", n=24, teach=False)  # GC timing needs no taught target
    cfg = TrainConfig(store=str(store), target=str(target), out=str(tmp_path / "run"), gpus="cpu:1", block_size=8,
                      num_layers=1, steps=6, warmup_steps=1, token_budget=256, num_anchors=8, num_workers=1,
                      compile="off", num_shapes=1, gc_every=2, save_every=0)
    launch_train(cfg)
    import json

    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    frac = {r["step"]: r["gc_frac"] for r in recs}
    assert frac[3] == 0 and frac[5] == 0  # automatic collection is off between the scheduled ones
    assert frac[4] > 0 and frac[6] > 0  # young generations every 2 steps
    assert gc.isenabled() and gc.get_freeze_count() == 0
