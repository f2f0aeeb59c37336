"""`dflash eval --workers N`: the online prompts split over N processes give one process's result, prompt
for prompt (the outputs, the acceptance counts, the lossless check, the reference file), and a mismatch
in the second worker's slice is reported at its own prompt index."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import make_conversations_jsonl, make_tiny_target

TIMING = {"tokens_per_s_target", "tokens_per_s_speculative", "speedup", "reference"}


def test_slices_are_contiguous_balanced_and_cover_every_prompt():
    from dflash.evaluate.workers import slices

    for n in range(1, 12):
        for w in range(1, 6):
            parts = slices(n, w)
            assert parts[0][0] == 0 and parts[-1][1] == n and len(parts) == min(n, w)
            assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
            sizes = [hi - lo for lo, hi in parts]
            assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from dflash.drafter import DFlashDrafter, DrafterConfig
    from dflash.target_model.files import target_config
    from dflash.train.checkpoint import save_checkpoint

    tmp = tmp_path_factory.mktemp("workers")
    target_dir = make_tiny_target(tmp, num_layers=4)
    chats = make_conversations_jsonl(tmp / "chats.jsonl", n=5, seed=4)
    tc = target_config(target_dir)
    cfg = DrafterConfig.from_target(tc, num_layers=1, block_size=8, target_layer_ids=[1, 3],
                                    mask_token_id=tc.vocab_size - 1)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    save_checkpoint(tmp / "run", 1, drafter.state_dict(), cfg.to_hf_dict(), {"step": 1},
                    {"train": {"target": str(target_dir)}})
    return tmp, chats


def _eval(tmp, chats, workers: int, out: str, *extra) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "dflash.cli", "eval", "--run", str(tmp / "run"), "--prompts", str(chats),
         "--max-new-tokens", "20", "--no-plots", "--workers", str(workers), "--out", str(tmp / out), *extra],
        capture_output=True, text=True, env=env, cwd=tmp, timeout=600)
    return {"rc": proc.returncode, "stderr": proc.stderr,
            "result": json.loads((tmp / out).read_text()) if proc.returncode == 0 else None}


@pytest.fixture(scope="module")
def one_process(run_dir):
    """`dflash eval --workers 1` writing its target-only reference (ref1.json): the result the workers must
    give, and the reference the mismatch test doctors (one eval for both, not one each).  One process: this
    one's (the workers' runs are real subprocesses)."""
    from processes import invoke

    tmp, chats = run_dir
    rc, _, err = invoke(["--run", tmp / "run", "--prompts", chats, "--max-new-tokens", "20", "--no-plots",
                         "--workers", "1", "--out", tmp / "one.json", "--reference", tmp / "ref1.json"],
                        command="eval", cwd=tmp)
    return {"rc": rc, "stderr": err, "result": json.loads((tmp / "one.json").read_text()) if rc == 0 else None}


@pytest.mark.slow
def test_workers_give_one_processs_result(run_dir, one_process):
    tmp, chats = run_dir
    one = one_process
    three = _eval(tmp, chats, 3, "three.json", "--reference", str(tmp / "ref3.json"))
    assert one["rc"] == 0 and three["rc"] == 0, (one["stderr"], three["stderr"])
    a, b = one["result"]["online"], three["result"]["online"]
    assert a["num_prompts"] == b["num_prompts"] == 5
    assert {k: v for k, v in a.items() if k not in TIMING} == {k: v for k, v in b.items() if k not in TIMING}
    assert b["lossless"] and b["new_tokens"] > 0
    # the workers' target-only outputs, merged in prompt order, are the reference one process writes
    gens = [json.loads((tmp / f).read_text())["generations"] for f in ("ref1.json", "ref3.json")]
    assert [g["tokens"] for g in gens[0]] == [g["tokens"] for g in gens[1]]


@pytest.mark.slow
def test_a_mismatch_in_a_later_slice_names_its_prompt(run_dir, one_process):
    """A doctored reference (prompt 4, the last worker's) must be what the workers compare against, and
    the mismatch must carry prompt 4, not the worker's own index 0 or 1."""
    tmp, chats = run_dir
    ref = tmp / "doctored.json"
    assert one_process["rc"] == 0, one_process["stderr"]
    body = json.loads((tmp / "ref1.json").read_text())  # the reference one process wrote
    body["generations"][4]["tokens"][0] += 1  # every output has its first token
    ref.write_text(json.dumps(body))
    bad = _eval(tmp, chats, 2, "d2.json", "--reference", str(ref))
    assert bad["rc"] != 0 and "Traceback" not in bad["stderr"]  # fp32: a mismatch is reported as a bug
    assert "differs from target-only greedy decoding on 1 of 5" in bad["stderr"] and "'prompt': 4" in bad["stderr"]


@pytest.mark.slow
def test_workers_against_a_batched_reference_give_one_processs_result(run_dir, one_process):
    """--batch-size: the parent decodes the target-only reference in batches, the workers decode against it
    (and decode --timed-prompts prompts target-only alone, for the speed-up): one process's outputs."""
    tmp, chats = run_dir
    two = _eval(tmp, chats, 2, "b2.json", "--batch-size", "4", "--timed-prompts", "2")
    assert one_process["rc"] == 0 and two["rc"] == 0, (one_process["stderr"], two["stderr"])
    a, b = one_process["result"]["online"], two["result"]["online"]
    same = ("tau", "acceptance", "tau_hist", "lossless", "mismatches", "num_prompts", "new_tokens", "per_prompt")
    assert {k: a[k] for k in same} == {k: b[k] for k in same}
    assert b["lossless"] and b["speedup"] > 0 and b["batched_reference_differs"] == []


def test_a_failing_worker_is_one_paragraph(run_dir):
    tmp, chats = run_dir
    bad = _eval(tmp, chats, 2, "f.json", "--device", "cuda:7") if not torch.cuda.is_available() else None
    if bad is None:
        pytest.skip("needs a machine without CUDA")
    assert bad["rc"] != 0 and "Traceback" not in bad["stderr"], bad["stderr"]
    assert "eval worker " in bad["stderr"] and "--workers 1" in bad["stderr"], bad["stderr"]
    assert "File \"" not in bad["stderr"]  # the worker's own error, one paragraph: no traceback lines either
