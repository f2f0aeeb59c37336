"""`--gpus` of `dflash train`: what each spelling starts, and that the default trains on the machine's GPUs."""

from __future__ import annotations

import pytest
import torch

from dflash.config import TrainConfig
from dflash.errors import ConfigError
from dflash.train.launch import Devices, parse_gpus


def test_gpus_spellings():
    assert parse_gpus("5,6,7") == Devices("cuda", (5, 6, 7))
    assert parse_gpus("cpu:3") == Devices("cpu", (0, 1, 2))
    assert parse_gpus("cpu") == Devices("cpu", (0,))
    for bad in ("cpu:0", "5,x", "1,1"):
        with pytest.raises(ConfigError):
            parse_gpus(bad)


def test_the_default_is_one_process_per_visible_gpu_and_one_cpu_process_without_cuda(monkeypatch):
    """A `dvc repro` of the example on a GPU machine passes no --gpus: it must train on the GPUs, not the CPU."""
    assert TrainConfig().job.gpus == "auto"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert parse_gpus("auto") == Devices("cpu", (0,))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert parse_gpus("auto") == parse_gpus("") == Devices("cuda", (0, 1, 2))
