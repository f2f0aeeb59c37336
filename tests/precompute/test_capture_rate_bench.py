"""bench/capture_rate.py at a tiny shape on the CPU: one command gives the bare forward, the capture and the
`dflash precompute` loop rates, their ratios and the writer's stages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import make_conversations_jsonl

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_capture_rate_tiny_cli(tmp_path):
    data = make_conversations_jsonl(tmp_path / "chats.jsonl", 24, min_words=20, max_words=60)
    out = tmp_path / "rate.json"
    cmd = [sys.executable, str(ROOT / "bench" / "capture_rate.py"), "--make-random", "tiny", str(tmp_path / "target"),
           "--tokenizer", str(ROOT / "tests" / "assets" / "smollm2-tokenizer"), "--data", str(data), "--rows", "24",
           "--max-length", "256", "--token-budget", "1024", "--layers", "2", "--cli", "--cli-dir", str(tmp_path),
           "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())["budgets"]["1024"]
    for k in ("forward_tok_per_s", "lm_head_tok_per_s", "capture_tok_per_s", "cli_tok_per_s"):
        assert r[k] > 0, k
    assert r["capture_over_lm_head"] == round(r["capture_tok_per_s"] / r["lm_head_tok_per_s"], 3)
    assert r["cli_over_forward"] > 0 and r["cli_new_tokens"] > 0 and r["cli_loop_s"] > 0
    assert r["cli_writer_s"]["commits"] >= 1 and "checksum" in r["cli_writer_s"]
    assert r["cli_writer_cpu_s"]["user"] >= 0 and r["cli_write_stall_s"] >= 0
    assert r["cli_capture_s"] > 0 and r["cli_render_wait_s"] >= 0 and r["cli_first_batch_s"] > 0
