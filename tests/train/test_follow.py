"""Training from a store that grows: each epoch plans over its snapshot of the committed samples; a resumed
run finishes its epoch over the samples it planned and later epochs cover the grown store; `--follow`
trains while precompute writes, through a writer killed and restarted."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from dflash.config import TrainConfig, to_dict
from dflash.errors import ConfigError
from dflash.store import open_store
from dflash.train.launch import launch_train
from helpers import build_store, make_tiny_target
from processes import committed, invoke, run_cli, slow_writes
from train_fixtures import counting_conversations

ROOT = Path(__file__).resolve().parents[2]


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(target, store, out, **kw) -> TrainConfig:
    base = dict(store=str(store), target=str(target), out=str(out), gpus="cpu:1", block_size=4, num_layers=1,
                steps=6, lr=3e-3, warmup_steps=2, token_budget=256, num_anchors=8, num_workers=1, compile="off",
                seed=0, save_every=0)
    return TrainConfig(**{**base, **kw})


def _metrics(run) -> list[dict]:
    """The records of a live metrics.jsonl: only whole lines, since the trainer may be mid-write of the last."""
    text = (Path(run) / "metrics.jsonl").read_text()
    return [json.loads(x) for x in text[:text.rfind("\n") + 1].splitlines() if x.strip()]


def _eligible(store) -> int:
    """Samples an epoch's plan can cover: those with at least one anchor."""
    return int(np.sum(np.asarray(open_store(store).num_supervised()) >= 2))


@pytest.fixture(scope="module")
def growing(tmp_path_factory):
    d = tmp_path_factory.mktemp("grow")
    rows = counting_conversations(36, seed=1)
    return dict(dir=d, target=make_tiny_target(d), rows=rows, first=_jsonl(d / "first.jsonl", rows[:18]),
                grown=_jsonl(d / "grown.jsonl", rows))


def test_resume_onto_a_grown_store(growing, tmp_path):
    target = growing["target"]
    store = build_store(tmp_path / "store", target, growing["first"])
    n0 = _eligible(store)
    launch_train(_cfg(target, store, tmp_path / "run", steps=3))
    before = _metrics(tmp_path / "run")
    assert {r["epoch"] for r in before} == {0} and {r["epoch_samples"] for r in before} == {n0}
    build_store(store, target, growing["grown"], append=True)
    n1 = _eligible(store)
    assert n1 > n0
    shutil.copytree(tmp_path / "run", tmp_path / "again")
    runs = []
    for run in ("run", "again"):  # the same store and checkpoint twice: the same losses
        launch_train(_cfg(target, store, tmp_path / run, steps=14, resume=True))
        runs.append(_metrics(tmp_path / run))
    rows = runs[0]
    assert [r["step"] for r in rows] == list(range(1, 15))
    assert [r["loss"] for r in runs[0]] == [r["loss"] for r in runs[1]]
    first_epoch = [r for r in rows if r["epoch"] == 0]
    later = [r for r in rows if r["epoch"] > 0]
    assert len(first_epoch) > 3 and later, "the checkpoint's epoch is finished, then new epochs start"
    assert {r["epoch_samples"] for r in first_epoch} == {n0}  # the epoch in progress keeps its plan
    assert {r["epoch_samples"] for r in later} == {n1}  # later epochs cover the grown store
    assert sum(r["samples"] for r in later if r["epoch"] == 1) <= n1


def test_follow_needs_steps_and_names_what_it_waits_for(growing, tmp_path):
    with pytest.raises(ConfigError, match="--follow needs --steps"):
        launch_train(_cfg(growing["target"], tmp_path / "nothing", tmp_path / "r", steps=None, follow=True))
    with pytest.raises(Exception, match="--follow gave up after 1 s waiting for store"):
        launch_train(_cfg(growing["target"], tmp_path / "nothing", tmp_path / "r2", follow=True, follow_poll=0.2,
                          follow_timeout=1))


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _wait(cond, timeout, proc, what, log: Path):
    t0 = time.time()
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"the trainer ended while waiting for {what} (exit code {proc.returncode}): "
                                 f"{log.read_text()[-3000:]}")
        assert time.time() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.slow
def test_follow_trains_while_precompute_writes_through_a_killed_writer(growing, tmp_path):
    target, store, run = growing["target"], tmp_path / "store", tmp_path / "run"
    cfg = _cfg(target, store, run, steps=100000, follow=True, follow_poll=0.2)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"train": to_dict(cfg)}))
    log = tmp_path / "trainer.log"
    with log.open("w") as out:  # a file, not a pipe: the trainer's progress bar must never block on us
        trainer = subprocess.Popen([sys.executable, "-m", "dflash.cli", "train", "--config",
                                    str(tmp_path / "params.yaml")], env=_env(), cwd=tmp_path, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # the trainer starts first and says what it waits for
        _wait(lambda: "waiting for store" in log.read_text(), 120, trainer, "the trainer to start waiting", log)
        args = ["--target", target, "--data", growing["grown"], "--out", store, "--gpus", "cpu", "--max-length", "256",
                "--topk", "4", "--target-layers", "1,2", "--token-budget", "256", "--commit-every-tokens", "200"]
        # killed once the trainer has planned its first epoch over what was committed (its progress bar is up)
        rc, _, _ = run_cli(args, env=slow_writes(0.5),
                           kill_when=lambda: "train:" in log.read_text() and committed(store) > 0)
        assert rc == -signal.SIGKILL and not open_store(store).complete  # the writer died mid-store
        partial = len(open_store(store))
        rc, _, err = invoke(args)  # restarted (in this process): it resumes and finishes the store
        assert rc == 0, err
        full = _eligible(store)
        _wait(lambda: (run / "metrics.jsonl").is_file() and _metrics(run), 120, trainer, "the first steps", log)
        done_epoch = max(r["epoch"] for r in _metrics(run))
        _wait(lambda: max(r["epoch"] for r in _metrics(run)) >= done_epoch + 2, 180, trainer,
              "an epoch planned after the store was finished", log)
    finally:
        os.killpg(trainer.pid, signal.SIGKILL)
        trainer.wait()
    assert "to be created by `dflash precompute`" in log.read_text()
    rows = _metrics(run)
    by_epoch = {}
    for r in rows:
        by_epoch.setdefault(r["epoch"], set()).add(r["epoch_samples"])
    assert all(len(v) == 1 for v in by_epoch.values()), "an epoch's plan never changes"
    sizes = [next(iter(by_epoch[e])) for e in sorted(by_epoch)]
    assert sizes == sorted(sizes), "later epochs plan over at least as many samples"
    assert sizes[0] <= partial < full and sizes[-1] == full
    assert rows[0]["data_wait_frac"] > 0, "the first step waited for data, and says so"



def _train_watching_workers(cfg: TrainConfig, grow=None) -> tuple[list[dict], dict[int, set[tuple]]]:
    """Train in this process; the loader's worker pids seen in each epoch.  `grow(step)`, called before
    every step, may append to the store."""
    from dflash.train import trainer as T
    from dflash.train.preflight import preflight

    seen: dict[int, set[tuple]] = {}
    step_once = T.Trainer.train_step

    def train_step(self, total):
        if grow is not None:
            grow(self.step)
        epoch = step_once(self, total)
        seen.setdefault(epoch, set()).add(tuple(w.pid for w in self.loader._iterator._workers))
        return epoch

    T.Trainer.train_step = train_step
    try:
        T.Trainer(preflight(cfg), torch.device("cpu")).train()
    finally:
        T.Trainer.train_step = step_once
    return _metrics(cfg.job.out), seen


def test_epochs_of_an_unchanged_store_reuse_the_loader_workers_and_a_grown_store_gets_new_ones(growing, tmp_path):
    target = growing["target"]
    store = build_store(tmp_path / "store", target, growing["first"])
    n0 = _eligible(store)
    rows, seen = _train_watching_workers(_cfg(target, store, tmp_path / "kept", steps=18, num_workers=2))
    assert len(seen) >= 3, "the run spans several epochs"
    assert all(len(pids) == 1 for pids in seen.values()), "one set of workers an epoch"
    assert len(set.union(*seen.values())) == 1, "the same workers in every epoch of an unchanged store"
    assert {r["epoch_samples"] for r in rows} == {n0}

    def grow(step):
        if step == 5:  # between two steps of one epoch: the next epoch's snapshot sees it
            build_store(store, target, growing["grown"], append=True)

    grown, seen = _train_watching_workers(_cfg(target, store, tmp_path / "grown", steps=18, num_workers=2), grow)
    n1 = _eligible(store)
    assert n1 > n0
    assert [r["loss"] for r in grown[:5]] == [r["loss"] for r in rows[:5]]
    grown_epoch = grown[5]["epoch"]  # step 6's epoch, the one in progress when the store grew
    before = [e for e in seen if e <= grown_epoch]
    after = [e for e in seen if e > grown_epoch]
    assert after and {r["epoch_samples"] for r in grown if r["epoch"] in after} == {n1}
    assert {r["epoch_samples"] for r in grown if r["epoch"] in before} == {n0}
    old = set.union(*(seen[e] for e in before))
    new = set.union(*(seen[e] for e in after))
    assert len(old) == 1 and len(new) == 1 and old != new, "new workers for the grown store's epochs, kept after"
