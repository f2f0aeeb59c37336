"""dflash.train.loss_kernel's Triton kernel, run on the CPU by Triton's interpreter, against the eager chunk
terms and the full-logits reference.  Triton reads TRITON_INTERPRET=1 when it is imported, so the checks
(tests/loss_kernel_checks.py) run in one subprocess started with it; each check is reported here as a test."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import loss_kernel_checks  # noqa: E402
from dflash.train import loss_kernel  # noqa: E402
from dflash.train.loss import block_loss, chunk_kernel, reference_block_loss  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT), str(ROOT / "tests")] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "loss_kernel_checks.py")], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(loss_kernel_checks.CHECKS))
def test_interpreted_kernel(interpreted, name):
    assert interpreted[name] == "ok", interpreted[name]


def test_block_loss_triton_falls_back_on_cpu(monkeypatch):
    """Without the interpreter a CPU tensor cannot run the kernel: --loss-kernel triton gets torch's path,
    and block_loss refuses the Triton kernel where it cannot run."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(loss_kernel, "fused_ce_terms", None)  # would raise if called
    hidden, head, labels, weights, _, _, B = loss_kernel_checks.batch()
    kernel = chunk_kernel("triton", False, hidden.device, compiled=False)
    assert kernel == "eager"
    out = block_loss(hidden, head, labels, weights, block_size=B, denom=1.0, chunk=7, kernel=kernel)
    ref = reference_block_loss(hidden, head, labels, weights, 1.0)
    assert torch.allclose(out.loss, ref, rtol=1e-5)
    for bad in ("tritn", "triton"):
        with pytest.raises(ValueError):
            block_loss(hidden, head, labels, weights, block_size=B, denom=1.0, kernel=bad)

