"""One writer per store, one trainer per run directory (dflash/locks.py), and the safe defaults: an
--overwrite that deletes only dflash directories, trust_remote_code only when asked for explicitly, a
single-node rendezvous on loopback.  Real processes throughout: holders are subprocesses, crashes are
SIGKILLs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash.cli import main
from dflash.config import PrecomputeConfig, TrainConfig, build_config
from dflash.errors import ConfigError, LockedError
from dflash.locks import dir_lock, lock_path, read_holder
from helpers import build_store, make_conversations_jsonl
from processes import invoke, slow_writes

ROOT = Path(__file__).resolve().parents[2]
DFLASH = [sys.executable, "-m", "dflash.cli"]


def _env(**extra) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _wait_for_holder(directory: Path, proc: subprocess.Popen, timeout: float = 120, also=lambda: True) -> dict:
    """The lock file's JSON once `proc` wrote its pid there (and `also()` holds)."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        info = read_holder(lock_path(directory))
        if info.get("pid") == proc.pid and also():
            return info
        assert proc.poll() is None, f"the holder ended early: {proc.communicate()[1][-3000:]}"
        time.sleep(0.05)
    raise AssertionError("the holder never took the lock")


def _kill_group(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    for f in (proc.stdout, proc.stderr):
        if f:
            f.close()


HOLD = """
import sys, time
from dflash.locks import dir_lock
with dir_lock(sys.argv[1], "store"):
    print("held", flush=True)
    time.sleep(600)
"""


# ---------------------------------------------------------------------------------------------- the lock


def test_lock_names_its_holder_and_a_killed_holders_lock_is_taken_over(tmp_path):
    d = tmp_path / "store"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(d)], env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert holder.stdout.readline().strip() == "held", holder.stderr.read()
        path = lock_path(d)
        assert path == tmp_path / ".store.dflash.lock" and not d.exists()  # beside the directory, not in it
        info = read_holder(path)
        assert info["pid"] == holder.pid and info["host"] and info["since"] and "-c" in info["argv"]
        with pytest.raises(LockedError) as e, dir_lock(d, "store"):
            pass
        msg = str(e.value)
        assert f"pid {holder.pid}" in msg and info["host"] in msg and info["since"] in msg and str(path) in msg
    finally:
        _kill_group(holder)  # kill -9: the kernel drops the flock, the file and its stale JSON stay
    assert read_holder(path)["pid"] == holder.pid
    with dir_lock(d, "store"):
        assert read_holder(path)["pid"] == os.getpid()  # taken over
        with pytest.raises(LockedError, match=f"pid {os.getpid()}"), dir_lock(d, "store"):
            pass  # another descriptor, even in the same process, is refused
    assert not path.exists()  # a clean release leaves nothing behind
    with dir_lock(d, "store"):  # and the lock can be taken again
        pass


# ---------------------------------------------------------------------------------------------- precompute


def _precompute_args(target, data, out, *more):
    return ["precompute", "--target", str(target), "--data", str(data), "--out", str(out), "--gpus", "cpu",
            "--max-length", "256", "--topk", "2", "--target-layers", "1,2", "--token-budget", "128",
            "--commit-every-tokens", "128", *more]


@pytest.mark.slow
def test_second_precompute_and_overwrite_are_refused_while_one_writes(tmp_path, tiny_target):
    from dflash.store import verify_store

    data = make_conversations_jsonl(tmp_path / "d.jsonl", 40, seed=3)
    store = tmp_path / "store"
    first = subprocess.Popen(DFLASH + _precompute_args(tiny_target, data, store), env=_env(**slow_writes(0.5)),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for_holder(store, first, also=lambda: (store / "manifest.json").is_file())
        manifest = (store / "manifest.json").read_bytes()
        # a second writer and an --overwrite, from another process (this one)
        for more in ((), ("--overwrite",)):
            rc, _, err = invoke(_precompute_args(tiny_target, data, store, *more), command=None)
            assert rc == 1, err
            assert f"pid {first.pid}" in err and "in use" in err, err
            assert "precompute" in err  # the holder's command
        assert first.poll() is None, "the writer did not survive the refusals"
        assert (store / "manifest.json").read_bytes() == manifest  # --overwrite deleted nothing
    finally:
        _kill_group(first)
    assert not verify_store(store).ok  # interrupted
    # the dead writer's lock is taken over: rerunning continues the store to the end
    build_store(store, tiny_target, data, topk=2, token_budget=128, commit_every_tokens=128)
    assert verify_store(store).ok
    assert not lock_path(store).exists()


def test_precompute_overwrite_deletes_only_a_store_or_an_empty_directory(tmp_path, tiny_target):
    data = make_conversations_jsonl(tmp_path / "d.jsonl", 6)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=f"--overwrite would delete {precious}, but it is not a dflash store"):
        build_store(precious, tiny_target, data, overwrite=True)
    assert (precious / "notes.txt").read_text() == "mine"
    bogus = tmp_path / "bogus"  # a manifest.json of something else
    bogus.mkdir()
    (bogus / "manifest.json").write_text('{"name": "not a store"}')
    with pytest.raises(ConfigError, match="not a dflash store"):
        build_store(bogus, tiny_target, data, overwrite=True)
    assert (bogus / "manifest.json").is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    build_store(empty, tiny_target, data, overwrite=True)
    build_store(empty, tiny_target, data, overwrite=True)  # a store is deleted and written again
    assert (empty / "manifest.json").is_file()


# ---------------------------------------------------------------------------------------------- train


def _train_cfg(tiny_store, out, **kw) -> TrainConfig:
    target, _, store = tiny_store
    base = dict(store=str(store), target=str(target), out=str(out), gpus="cpu:1", block_size=4, num_layers=1,
                steps=2, token_budget=256, num_anchors=4, num_workers=1, compile="off", seed=0, save_every=0,
                warmup_steps=1)
    base.update(kw)
    return TrainConfig(**base)


def _train_args(cfg: TrainConfig, params: Path, *more) -> list[str]:
    import yaml

    from dflash.config import to_dict

    params.write_text(yaml.safe_dump({"train": {k: v for k, v in to_dict(cfg).items() if v is not None}}))
    return DFLASH + ["train", "--config", str(params), *more]


@pytest.mark.slow
def test_second_train_resume_and_overwrite_are_refused_while_one_trains(tmp_path, tiny_store):
    from dflash.train.launch import launch_train

    run = tmp_path / "run"
    cfg = _train_cfg(tiny_store, run, steps=100000)
    # niced: the holder trains all along, and the refused commands must not queue behind it for the CPU
    first = subprocess.Popen(["nice", "-n", "19", *_train_args(cfg, tmp_path / "p1.yaml")], env=_env(),
                             stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for_holder(run, first, timeout=240, also=lambda: (run / "metrics.jsonl").is_file())
        for i, more in enumerate([(), ("--resume",), ("--overwrite",)], start=2):  # from another process (this one)
            rc, _, err = invoke(_train_args(cfg, tmp_path / f"p{i}.yaml", *more)[len(DFLASH):], command=None)
            assert rc == 1, err
            assert f"pid {first.pid}" in err and "run directory" in err, err
        assert first.poll() is None, "the trainer did not survive the refusals"
        assert (run / "metrics.jsonl").is_file()  # --overwrite deleted nothing
    finally:
        _kill_group(first)
    # the killed trainer's lock is taken over; its directory is a run, so --overwrite may delete it
    launch_train(_train_cfg(tiny_store, run, overwrite=True))
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    assert not lock_path(run).exists()


@pytest.mark.slow
def test_killing_only_the_launcher_stops_its_training_processes(tmp_path, tiny_store):
    """`dflash train --gpus cpu:2` holds the run lock in the launcher; SIGKILL of the launcher alone (not
    its process group) frees the lock, so its two training processes must end with it, not train on."""
    from processes import alive, descendants

    run = tmp_path / "run"
    cfg = _train_cfg(tiny_store, run, steps=100000, gpus="cpu:2")
    launcher = subprocess.Popen(["nice", "-n", "10", *_train_args(cfg, tmp_path / "p.yaml")], env=_env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for_holder(run, launcher, timeout=240, also=lambda: (run / "metrics.jsonl").is_file())
        family = descendants(launcher.pid)  # the trainers, their loaders' forkservers and workers
        trainers = [q for q in family if b"spawn_main" in Path(f"/proc/{q}/cmdline").read_bytes()
                    and Path(f"/proc/{q}/stat").read_text().rsplit(")", 1)[1].split()[1] == str(launcher.pid)]
        assert len(trainers) == 2, trainers  # the two training processes, children of the launcher
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)
        t0 = time.time()
        while [q for q in family if alive(q)] and time.time() - t0 < 20:
            time.sleep(0.05)
        assert not [q for q in trainers if alive(q)], "training processes outlived their launcher and its lock"
        assert not [q for q in family if alive(q)], "loader processes outlived their trainers"
        with dir_lock(run, "run directory"):  # free: nobody trains this run any more
            pass
    finally:
        _kill_group(launcher)


def test_train_overwrite_deletes_only_a_run_or_an_empty_directory(tmp_path, tiny_store):
    from dflash.train.launch import launch_train

    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "config.json").write_text('{"model_type": "not a run"}')
    with pytest.raises(ConfigError, match=f"--overwrite would delete {precious}, but it is not a dflash run"):
        launch_train(_train_cfg(tiny_store, precious, overwrite=True))
    assert (precious / "config.json").is_file()
    assert not lock_path(precious).exists()  # released on the refusal


def test_a_train_lock_held_elsewhere_refuses_before_any_check(tmp_path, tiny_store):
    """The lock comes first: the refusal names the holder, not the busy directory."""
    from dflash.train.launch import launch_train

    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert holder.stdout.readline().strip() == "held", holder.stderr.read()
        run.mkdir()
        (run / "metrics.jsonl").write_text("")
        for kw in ({}, {"resume": True}, {"overwrite": True}):
            with pytest.raises(LockedError, match=f"pid {holder.pid}"):
                launch_train(_train_cfg(tiny_store, run, **kw))
        assert (run / "metrics.jsonl").is_file()
    finally:
        _kill_group(holder)


def _torchrun(*args, cwd):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "dflash.cli", *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)


def _holder(directory: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(directory)], env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert p.stdout.readline().strip() == "held", p.stderr.read()
    return p


@pytest.mark.slow
def test_under_torchrun_rank0_holds_the_locks(tmp_path, tiny_target):
    """Both stages under torchrun (2 ranks): refused while another process holds the lock, naming it; the
    lock is free once the holder is killed (the stages' success under torchrun is tests/train/test_torchrun.py's)."""
    data = make_conversations_jsonl(tmp_path / "d.jsonl", 8)
    store, run = tmp_path / "store", tmp_path / "run"
    pre = ["precompute", "--target", tiny_target, "--data", data, "--out", store, "--gpus", "cpu",
           "--target-layers", "1,2", "--max-length", "128", "--topk", "2"]
    train = ["train", "--store", store, "--target", tiny_target, "--out", run, "--gpus", "cpu:2", "--steps", "2",
             "--block-size", "4", "--num-layers", "1", "--token-budget", "256", "--num-anchors", "4",
             "--num-workers", "1", "--compile", "off"]
    for directory, args in ((store, pre), (run, train)):
        holder = _holder(directory)
        try:
            p = _torchrun(*args, cwd=tmp_path)
            assert p.returncode != 0 and f"pid {holder.pid}" in p.stderr, p.stderr[-3000:]
        finally:
            _kill_group(holder)
        with dir_lock(directory, "test", "--out"):  # the killed holder's lock is taken over
            assert lock_path(directory).exists()
        assert not lock_path(directory).exists()


# ---------------------------------------------------------------------------------------------- safe defaults


def test_implicit_params_yaml_may_not_turn_on_trust_remote_code(tmp_path, tiny_target, monkeypatch):
    (tmp_path / "params.yaml").write_text("precompute:\n  trust_remote_code: true\n")
    monkeypatch.chdir(tmp_path)
    args = ["precompute", "--target", str(tiny_target), "--data", "none.jsonl", "--out", str(tmp_path / "s")]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert "params.yaml" in res.output and "not named with --config" in res.output and "--trust-remote-code" in res.output
    assert not (tmp_path / "s").exists()


def test_trust_remote_code_from_flag_or_named_config_is_announced(tmp_path, capsys):
    params = tmp_path / "params.yaml"
    params.write_text("precompute:\n  trust_remote_code: true\n")
    cfg = build_config(PrecomputeConfig, params, {}, explicit=True)
    assert cfg.trust_remote_code
    assert f"trust_remote_code is on (from {params})" in capsys.readouterr().err
    cfg = build_config(PrecomputeConfig, None, {"trust_remote_code": True}, explicit=False)
    assert cfg.trust_remote_code and "trust_remote_code is on (from the command line)" in capsys.readouterr().err
    cfg = build_config(PrecomputeConfig, params, {"trust_remote_code": False}, explicit=False)
    assert not cfg.trust_remote_code and "trust_remote_code" not in capsys.readouterr().err  # the flag wins
    cfg = build_config(PrecomputeConfig, None, {}, explicit=False)
    assert not cfg.trust_remote_code and capsys.readouterr().err == ""


def test_single_node_rendezvous_is_on_loopback():
    from torch.distributed.launcher.api import elastic_launch

    from dflash.train.launch import launch_config

    lc = launch_config(2)
    assert lc.rdzv_endpoint.rsplit(":", 1)[0] == "127.0.0.1" and lc.local_addr == "127.0.0.1"
    # what the launched processes are really given
    got = elastic_launch(lc, os.getenv)("MASTER_ADDR")
    assert got == {0: "127.0.0.1", 1: "127.0.0.1"}


def test_locks_import_only_errors():
    import ast

    tree = ast.parse((ROOT / "dflash" / "locks.py").read_text())
    mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert {m for m in mods if m and m.startswith("dflash")} == {"dflash.errors"}
