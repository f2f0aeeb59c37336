"""The command-line contract: params.yaml + flags, help texts, and GPU requests on a CPU-only machine."""

import pytest
import torch
from click.testing import CliRunner

from dflash.cli import main
from dflash.config import PrecomputeConfig, TrainConfig, build_config
from dflash.errors import ConfigError
from helpers import make_conversations_jsonl


def test_help_lists_every_command_of_the_contract():
    out = CliRunner().invoke(main, ["--help"]).output
    for cmd in ("precompute", "verify", "train", "eval", "export"):
        assert f"  {cmd} " in out, cmd
    for cmd, flag in (("precompute", "--target-layers"), ("train", "--save-every"), ("eval", "--prompts")):
        res = CliRunner().invoke(main, [cmd, "--help"])
        assert res.exit_code == 0 and flag in res.output


def test_flags_win_over_params_yaml_which_wins_over_defaults(tmp_path):
    p = tmp_path / "params.yaml"
    p.write_text("train:\n  lr: 0.002\n  block_size: 8\n  gpus: 'cpu:2'\nprecompute:\n  target_layers: [1, 2]\n")
    cfg = build_config(TrainConfig, p, {"block_size": 16, "steps": None})
    assert (cfg.lr, cfg.block_size, cfg.gpus, cfg.num_layers) == (0.002, 16, "cpu:2", TrainConfig().num_layers)
    pre = build_config(PrecomputeConfig, p, {"target_layers": "3,4"})
    assert pre.target_layers == [3, 4]
    assert build_config(PrecomputeConfig, p, {}).target_layers == [1, 2]


def test_the_default_store_feeds_the_default_drafter():
    """Precompute's default target layers are chosen for train's default depth (docs/RECIPE.md: 3 layers
    reading 3 target layers), and the default store never holds the target's last layer."""
    from dflash.target_model.files import default_target_layers

    depth = TrainConfig().num_layers
    assert PrecomputeConfig().num_draft_layers == depth == 3
    assert default_target_layers(36, depth) == [1, 17, 33]  # Qwen3-8B: 36 layers, the last (35) never taken


def test_unknown_or_bad_params_are_named(tmp_path):
    p = tmp_path / "params.yaml"
    p.write_text("train:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError, match="unknown option `lrr`"):
        build_config(TrainConfig, p, {})
    p.write_text("train:\n  steps: many\n")
    with pytest.raises(ConfigError, match="`steps`"):
        build_config(TrainConfig, p, {})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown where CUDA is missing")
def test_gpu_requests_without_cuda_say_how_to_run_on_cpu(tmp_path, tiny_target):
    data = make_conversations_jsonl(tmp_path / "d.jsonl", 4)
    store = tmp_path / "store"
    res = CliRunner().invoke(main, ["precompute", "--target", str(tiny_target), "--data", str(data),
                                    "--out", str(store), "--shards", "2", "--gpus", "0,1"])
    assert res.exit_code != 0 and "--gpus cpu" in res.output and "Traceback" not in res.output
    assert not store.exists()
    res = CliRunner().invoke(main, ["train", "--store", str(store), "--target", str(tiny_target),
                                    "--out", str(tmp_path / "run"), "--gpus", "5,6,7"])
    assert res.exit_code != 0 and "--gpus cpu:N" in res.output and "Traceback" not in res.output


OOM = ("CUDA out of memory. Tried to allocate 9.02 GiB. GPU 0 has a total capacity of 79.18 GiB of which 788.19 "
       "MiB is free. Including non-PyTorch memory, this process has 78.40 GiB memory in use. Of the allocated "
       "memory 77.70 GiB is allocated by PyTorch, and 39.64 MiB is reserved by PyTorch but unallocated.")


@pytest.mark.parametrize("command,entry,less", [
    ("eval", "dflash.evaluate.run.run_eval", "--batch-size"),
    ("generate", "dflash.generate.run.run_generate", "--batch-tokens"),
    ("precompute", "dflash.precompute.run.run_precompute", "--token-budget"),
])
def test_a_gpu_out_of_memory_is_one_paragraph_naming_what_to_lower(tmp_path, monkeypatch, command, entry, less):
    """torch's OutOfMemoryError, raised where the command's work runs, ends it with one paragraph: what
    was asked and what the card had, and the flag that holds less at once; --debug keeps the traceback."""
    module, name = entry.rsplit(".", 1)

    def out_of_memory(_cfg):
        raise torch.OutOfMemoryError(OOM)

    monkeypatch.setattr(f"{module}.{name}", out_of_memory)
    monkeypatch.chdir(tmp_path)
    args = {"eval": ["--prompts", "p.jsonl", "--target", "t"], "generate": ["--target", "t", "--data", "d.jsonl"],
            "precompute": ["--target", "t", "--data", "d.jsonl", "--out", "s"]}[command]
    res = CliRunner().invoke(main, [command, *args])
    assert res.exit_code == 1, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in res.output
    assert lines[0].startswith(f"error: {command}: the GPU ran out of memory (CUDA out of memory. Tried to "
                               "allocate 9.02 GiB. GPU 0 has a total capacity of 79.18 GiB of which 788.19 MiB is "
                               "free). Rerun the same command with less at once (")
    assert less in lines[0] and "Including" not in lines[0]
    debug = CliRunner().invoke(main, ["--debug", command, *args])
    assert isinstance(debug.exception, torch.OutOfMemoryError)


def test_other_failures_keep_their_traceback(tmp_path, monkeypatch):
    """Only a GPU out of memory is turned into a message: anything else is a bug and keeps its traceback."""
    def broken(_cfg):
        raise RuntimeError("a bug")

    monkeypatch.setattr("dflash.evaluate.run.run_eval", broken)
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["eval", "--prompts", "p.jsonl", "--target", "t"])
    assert isinstance(res.exception, RuntimeError) and "a bug" in str(res.exception)


def test_a_shard_or_trainer_process_out_of_memory_reaches_the_launcher_as_one_paragraph(tmp_path, monkeypatch):
    """Out of memory in a spawned precompute shard or a training process is reported to its launcher as a
    user error (the one paragraph), not as a bug with the child's traceback."""
    import os

    from dflash.config import PrecomputeConfig
    from dflash.errors import DFlashError
    from dflash.precompute import run as precompute_run
    from dflash.precompute.shard import ShardJob
    from dflash.spawned import raise_failure
    from dflash.train import launch

    def out_of_memory(*_a, **_k):
        raise torch.OutOfMemoryError(OOM)

    sent = []

    class Queue:
        def put(self, item):
            sent.append(item)

    monkeypatch.setattr(precompute_run, "run_shard", out_of_memory)
    with pytest.raises(SystemExit):
        precompute_run._shard_entry(ShardJob(PrecomputeConfig(), 3, 4, "cpu", [1]), Queue())
    (kind, shard, message), = sent
    assert (kind, shard) == ("user", 3) and message.startswith("precompute: the GPU ran out of memory (CUDA out")
    with pytest.raises(DFlashError, match=r"^shard 3 failed: precompute: the GPU ran out of memory .*--token-budget"):
        raise_failure(sent[0], "shard 3", "")

    monkeypatch.setattr("dflash.train.trainer.run_training", out_of_memory)
    monkeypatch.setattr("dflash.spawned.die_with_parent", lambda _pid=None: None)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(torch.OutOfMemoryError):  # the process still fails; the launcher reads its file
        launch._worker(None, "cpu", (0,), str(tmp_path), os.getpid())
    said = (tmp_path / "rank1.txt").read_text()
    assert said.startswith("train: the GPU ran out of memory (CUDA out of memory.") and "--rows-per-batch" in said
