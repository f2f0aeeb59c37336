"""The capture's warm-up and the shard loop's steady rate (docs/DESIGN.md, precompute)."""

from __future__ import annotations

import json

import torch

from dflash.config import PrecomputeConfig
from dflash.precompute.run import run_precompute
from dflash.precompute.shard import _steady
from dflash.store.manifest import shard_status
from dflash.target_model.capture import Capture, load_target
from helpers import make_conversations, make_tiny_target


def test_steady_rate_leaves_out_the_first_batch():
    assert _steady(None, 5.0, 100) == {}
    assert _steady((2.0, 1000), 6.0, 5000) == {"first_batch_s": 2.0, "steady_tok_per_s": 1000.0}
    assert _steady((6.0, 5000), 6.0, 5000) == {"first_batch_s": 6.0}  # one batch: no rate after it


def test_warm_up_changes_no_capture(tmp_path):
    target = make_tiny_target(tmp_path, arch="llama")
    model = load_target(target, torch.float32, torch.device("cpu"))
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([12, 7])
    cold = Capture(model, [0, 1], topk=3, compile="off", final_hidden=True)(ids, lengths)
    warm = Capture(model, [0, 1], topk=3, compile="off", final_hidden=True)
    warm.warm_up(token_id=5, length=9)
    again = warm(ids, lengths)
    assert cold.keys() == again.keys()
    for k in cold:
        assert torch.equal(cold[k], again[k]), k


def test_shard_status_records_first_batch_and_steady_rate(tmp_path):
    target = make_tiny_target(tmp_path, arch="qwen3")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in make_conversations(24, seed=3, min_words=20, max_words=40)))
    run_precompute(PrecomputeConfig(target=str(target), data=str(data), out=str(tmp_path / "s"), gpus="cpu",
                                    target_layers=[1], topk=2, token_budget=128))
    st = shard_status(tmp_path / "s", 0)
    assert 0 < st["first_batch_s"] <= st["loop_s"]
    assert st["steady_tok_per_s"] > 0  # many batches under a 128-token budget
    # where the loop's time went: waiting for rendered rows, the capture call, the hand-off to the writer
    parts = [st["render_wait_s"], st["capture_s"], st["submit_s"]]
    assert all(x >= 0 for x in parts) and st["capture_s"] > 0 and st["submit_s"] > 0
    assert sum(parts) <= st["loop_s"] + 1e-3
