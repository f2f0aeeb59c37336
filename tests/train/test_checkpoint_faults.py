"""Checkpoint faults as messages: a truncated model.safetensors, a full disk, file permissions.

Checkpoints are real ones (save_checkpoint of a real DFlashDrafter built for the tiny target, or a real
training run), damaged on disk by the test.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from dflash.errors import DFlashError
from dflash.train import checkpoint as ckpt


@pytest.fixture(scope="module")
def drafter(tiny_store):
    from dflash.drafter import DFlashDrafter, DrafterConfig
    from dflash.target_model.files import target_config

    target, _, _ = tiny_store
    cfg = DrafterConfig.from_target(target_config(str(target)), 1, 4, [1, 2], 580)
    torch.manual_seed(0)
    return DFlashDrafter(cfg)


def _save(run: Path, step: int, drafter, target) -> Path:
    return ckpt.save_checkpoint(run, step, drafter.state_dict(), drafter.config.to_hf_dict(),
                                {"step": step, "rng": {"cpu": torch.get_rng_state()}},
                                {"train": {"target": str(target)}}, keep=5)


def _truncate(path: Path, keep: int | None = None) -> None:
    b = path.read_bytes()
    path.write_bytes(b[: len(b) // 2 if keep is None else keep])


def test_checkpoint_and_export_files_are_readable_by_others(tmp_path, drafter, tiny_store):
    from dflash.evaluate.export import export_drafter

    old = os.umask(0o077)  # even under a strict umask: the mode is set, not inherited
    try:
        p = _save(tmp_path / "run", 2, drafter, tiny_store[0])
        out = export_drafter(drafter, tmp_path / "export")
    finally:
        os.umask(old)
    for f in ["model.safetensors", "config.json", "train_config.json", "train_state.pt"]:
        assert (p / f).stat().st_mode & 0o777 == 0o644, f
    for f in ["model.safetensors", "config.json"]:
        assert (out / f).stat().st_mode & 0o777 == 0o644, f


@pytest.mark.parametrize("cut", [None, 4, 0])  # half the file, inside the header length, empty
def test_truncated_safetensors_is_named(tmp_path, drafter, tiny_store, cut):
    p = _save(tmp_path / "run", 2, drafter, tiny_store[0])
    ckpt.check_safetensors(p / "model.safetensors")  # sound: no error
    _truncate(p / "model.safetensors", cut)
    with pytest.raises(DFlashError, match=f"{p / 'model.safetensors'} is truncated"):
        ckpt.check_safetensors(p / "model.safetensors")
    with pytest.raises(DFlashError, match=f"checkpoint {p} cannot be read: .*model.safetensors is truncated"):
        ckpt.load_checkpoint(p)


def test_resume_falls_back_to_previous_complete_checkpoint(tmp_path, drafter, tiny_store, capsys):
    run = tmp_path / "run"
    first = _save(run, 2, drafter, tiny_store[0])
    newest = _save(run, 4, drafter, tiny_store[0])
    _truncate(newest / "model.safetensors")
    path, (state, dcfg, train_state, _) = ckpt.load_latest(run)
    assert path == first and train_state["step"] == 2 and dcfg == drafter.config.to_hf_dict()
    assert set(state) == set(drafter.state_dict()) - {k for k in drafter.state_dict() if k.startswith("rotary")}
    err = capsys.readouterr().err
    assert f"skipping checkpoint {newest}" in err and "model.safetensors is truncated" in err
    assert f"resuming from the previous complete checkpoint {first}" in err
    # nothing readable at all: one message naming each
    _truncate(first / "model.safetensors")
    with pytest.raises(DFlashError, match=f"no checkpoint of {run} can be read"):
        ckpt.load_latest(run)
    assert ckpt.load_latest(tmp_path / "empty") is None


def test_eval_and_export_name_the_truncated_file(tmp_path, drafter, tiny_store):
    from click.testing import CliRunner

    from dflash.cli import main

    target, _, store = tiny_store
    run = tmp_path / "run"
    p = _save(run, 2, drafter, target)
    _truncate(p / "model.safetensors")
    for args in (["export", str(run), str(tmp_path / "export")],
                 ["eval", "--run", str(run), "--store", str(store), "--target", str(target), "--device", "cpu"]):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 1, r.output
        assert f"{p / 'model.safetensors'} is truncated" in r.output and "earlier checkpoint" in r.output
        assert "Traceback" not in r.output
    assert not (tmp_path / "export").exists()


def test_eval_refuses_an_unfinished_store(tmp_path, drafter, tiny_store):
    """Offline tau of a store precompute is still writing would measure a moving subset: refused."""
    import shutil

    from click.testing import CliRunner

    from dflash.cli import main

    target, _, src = tiny_store
    store = tmp_path / "store"
    shutil.copytree(src, store)
    status = store / "shard-00000" / "status.json"
    status.write_text(json.dumps({**json.loads(status.read_text()), "status": "running"}))
    run = tmp_path / "run"
    _save(run, 2, drafter, target)
    r = CliRunner().invoke(main, ["eval", "--run", str(run), "--store", str(store), "--target", str(target),
                                  "--device", "cpu", "--out", str(tmp_path / "eval.json")])
    assert r.exit_code == 1, r.output
    assert f"store {store} is not complete" in r.output and "still writing" in r.output
    assert "--overwrite" not in r.output and "Traceback" not in r.output


def _assert_disk_full(e, run: Path) -> None:
    msg = str(e.value)
    assert f"no space left on the device while writing checkpoint {ckpt.checkpoint_path(run, 2)}" in msg
    assert f"free space on {run / 'checkpoints'}" in msg and "--resume" in msg
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp-")]  # space given back


def test_disk_full_while_saving_a_checkpoint(full_disk):
    run = full_disk / "run"
    big = {"w": torch.zeros(256 * 1024)}  # 1 MiB of fp32 on a 200 KiB filesystem
    with pytest.raises(DFlashError) as e:
        ckpt.save_checkpoint(run, 2, big, {}, {}, {})
    _assert_disk_full(e, run)


def test_disk_full_checkpoint_at_fsync(tmp_path, monkeypatch, drafter, tiny_store):
    run = tmp_path / "run"
    real = os.fsync

    def fsync(fd):
        if "train_state.pt" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(DFlashError) as e:
        _save(run, 2, drafter, tiny_store[0])
    _assert_disk_full(e, run)
    assert ckpt.list_checkpoints(run) == []


@pytest.mark.slow  # two short CPU training runs, ~30 s
def test_training_resumes_past_a_truncated_checkpoint(tiny_store, tmp_path, capfd):
    from dflash.config import TrainConfig
    from dflash.train.launch import launch_train

    target, _, store = tiny_store
    out = tmp_path / "run"
    kw = dict(store=str(store), target=str(target), out=str(out), gpus="cpu:1", block_size=4, num_layers=1,
              token_budget=256, num_anchors=4, num_workers=1, compile="off", seed=0, save_every=2,
              keep_checkpoints=3, warmup_steps=1)
    launch_train(TrainConfig(steps=4, **kw))
    newest = ckpt.checkpoint_path(out, 4)
    _truncate(newest / "model.safetensors")
    capfd.readouterr()
    launch_train(TrainConfig(steps=6, resume=True, **kw))
    err = capfd.readouterr().err
    assert f"skipping checkpoint {newest}" in err and "is truncated" in err
    assert f"resuming from the previous complete checkpoint {ckpt.checkpoint_path(out, 2)}" in err
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 6
    ckpt.check_safetensors(ckpt.checkpoint_path(out, 4) / "model.safetensors")  # step 4 written again, whole


def test_checkpoint_writer_raises_a_write_error_at_wait(tmp_path, monkeypatch):
    """The writer thread's disk-full error is not lost: save() returns, the next wait() raises it, named as
    save_checkpoint names it, and the writer writes the next checkpoint once the disk has room."""
    run = tmp_path / "run"
    real, full = os.fsync, [True]

    def fsync(fd):
        if full[0] and "train_state.pt" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    writer = ckpt.CheckpointWriter()
    state = {"w": torch.arange(6.0)}
    writer.save(run, 2, state, {}, {"step": 2}, {})  # returns: the error is the thread's
    with pytest.raises(DFlashError) as e:
        writer.wait()
    _assert_disk_full(e, run)
    full[0] = False
    writer.save(run, 3, state, {}, {"step": 3}, {})
    writer.wait()
    assert ckpt.list_checkpoints(run) == [ckpt.checkpoint_path(run, 3)] and writer.written[-1] == ckpt.checkpoint_path(run, 3)


def test_host_snapshot_copies_what_training_goes_on_changing():
    """On the CPU the gathered state can be the live tensors: the snapshot the writer thread gets is a copy,
    nested structure and plain values kept; a later in-place update does not reach it."""
    live = torch.nn.Parameter(torch.ones(4))
    state = {"model": {"w": live.data}, "optimizer": {"state": {0: {"exp_avg": torch.zeros(4), "step": 3}}}, "step": 7}
    snap = ckpt.host_snapshot(state, torch.device("cpu"))
    with torch.no_grad():
        live.add_(1.0)
        state["optimizer"]["state"][0]["exp_avg"].add_(5.0)
    assert torch.equal(snap["model"]["w"], torch.ones(4)) and torch.equal(snap["optimizer"]["state"][0]["exp_avg"], torch.zeros(4))
    assert snap["step"] == 7 and snap["optimizer"]["state"][0]["step"] == 3
