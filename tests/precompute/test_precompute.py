"""Stage one end to end: stored data equals a direct forward, sharding, kill -9 + resume, bad input."""

from __future__ import annotations

import json
import re
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from dflash.chat import conversation_of, load_rows, render
from dflash.cli import main
from dflash.config import PrecomputeConfig
from dflash.errors import StoreError
from dflash.precompute.run import run_precompute
from dflash.precompute.shard import plan_batches
from dflash.store import open_store, verify_store
from dflash.target_model.capture import load_target, load_tokenizer
from helpers import build_store, differing_files, make_conversations, make_conversations_jsonl, make_tiny_target
from processes import Same, committed, invoke, run_cli, slow_writes, store_arrays

DFLASH = str(Path(sys.executable).with_name("dflash"))


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    d = tmp_path_factory.mktemp("targets")
    return {arch: make_tiny_target(d, arch=arch) for arch in ("qwen3", "llama")}


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_store_equals_direct_forward(tmp_path, targets, arch):
    target = targets[arch]
    data = make_conversations_jsonl(tmp_path / "d.jsonl", 10, seed=5)
    # a small token budget makes batches of several padded rows
    store = build_store(tmp_path / "s", target, data, target_layers=[0, 1, 2], topk=5, token_budget=300)
    assert verify_store(store).ok
    s = open_store(store)
    assert s.manifest["target_layer_ids"] == [0, 1, 2] and s.topk == 5
    assert s.sample_ids() == list(range(10))
    tok = load_tokenizer(target)
    model = load_target(target, torch.float32, torch.device("cpu"))
    ds = load_rows(data)
    for sid in s.sample_ids():
        got = s.read(sid)
        want = render(tok, conversation_of(ds[sid], sid, data), 256)
        assert got["input_ids"].tolist() == want.input_ids
        assert got["loss_mask"].tolist() == [bool(m) for m in want.loss_mask]
        with torch.no_grad():
            ref = model(torch.tensor([want.input_ids]), output_hidden_states=True, use_cache=False)
        h = torch.cat([ref.hidden_states[i + 1][0] for i in (0, 1, 2)], dim=-1)
        assert got["hidden"].dtype == torch.bfloat16
        # fp32 compute, stored as bf16: equal up to bf16 rounding (batched vs single forward may differ
        # in the last fp32 bits, which can move a value across a bf16 rounding boundary)
        torch.testing.assert_close(got["hidden"].float(), h, rtol=2**-7, atol=1e-6)
        assert (got["hidden"] == h.to(torch.bfloat16)).float().mean() > 0.99
        lp, ix = torch.log_softmax(ref.logits[0].float(), dim=-1).topk(5, dim=-1)
        assert torch.equal(got["topk_ids"], ix)
        torch.testing.assert_close(got["topk_logprobs"], lp, rtol=0, atol=1e-5)


def test_fp8_store_dequantises_close_to_bf16(tmp_path, targets):
    data = make_conversations_jsonl(tmp_path / "d.jsonl", 4, seed=8)
    a = store_arrays(build_store(tmp_path / "bf16", targets["qwen3"], data, topk=0))
    s = open_store(build_store(tmp_path / "fp8", targets["qwen3"], data, topk=0, hidden_dtype="fp8"))
    assert s.manifest["hidden_dtype"] == "fp8" and verify_store(tmp_path / "fp8").ok
    for sid, ref in a.items():
        got = s.read(sid)
        want = torch.from_numpy(ref["hidden"]).view(torch.bfloat16).float()
        assert np.array_equal(got["input_ids"].numpy(), ref["input_ids"])
        # e4m3 keeps 3 mantissa bits: relative error <= 1/16 per value, scaled per token and layer
        scale = want.reshape(len(want), 2, -1).abs().amax(-1, keepdim=True).expand(-1, -1, want.shape[1] // 2)
        assert ((got["hidden"].float() - want).abs() <= want.abs() / 16 + scale.reshape(want.shape) / 448 * 2).all()


def test_truncation_and_skips_are_counted(tmp_path, targets, capsys):
    rows = make_conversations(12, seed=2, min_words=20, max_words=40)
    rows[3] = {"messages": [{"role": "user", "content": "no reply here"}]}
    rows[7] = {"messages": [{"role": "system", "content": "a " * 200}, {"role": "user", "content": "x"},
                            {"role": "assistant", "content": "cut off"}]}  # the reply lies past max_length
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = load_tokenizer(targets["qwen3"])
    max_length = 90
    cut = [render(tok, conversation_of(r, i, data), max_length) for i, r in enumerate(rows)]
    kept = [i for i, r in enumerate(cut) if any(r.loss_mask)]
    n_trunc = sum(cut[i].truncated for i in kept)
    n_cut = sum(r.truncated and not any(r.loss_mask) for r in cut)  # row 7: the reply lies past the cut
    n_skip = len(rows) - len(kept) - n_cut
    assert 3 not in kept and 7 not in kept and n_trunc >= 2 and len(kept) >= 6 and n_cut >= 1 and n_skip >= 1
    tot = run_precompute(PrecomputeConfig(target=str(targets["qwen3"]), data=str(data), out=str(tmp_path / "s"),
                                          gpus="cpu", max_length=max_length, target_layers=[1], topk=0))
    assert (tot["skipped"], tot["cut_away"], tot["truncated"], tot["num_samples"]) == (n_skip, n_cut, n_trunc, len(kept))
    out = capsys.readouterr().out
    assert f"skipped {n_skip} without supervised tokens, truncated {n_trunc} to {max_length} tokens and {n_cut} " \
        "more that --max-length cut before any reply token" in out, out
    s = open_store(tmp_path / "s")
    assert s.sample_ids() == kept
    assert s.lengths().max() == max_length and s.topk == 0
    shard = s.manifest["shards"]["shard-00000"]
    assert shard["skipped"] == n_skip and shard["truncated"] == n_trunc and shard["cut_away"] == n_cut
    assert verify_store(tmp_path / "s").ok


def test_plan_batches_respects_budget():
    lengths = [5, 40, 7, 40, 12, 3, 90]
    batches = plan_batches(lengths, 80)
    assert sorted(i for b in batches for i in b) == list(range(7))
    assert batches[0] == [6]  # longest first, alone when it does not fit with another
    assert all(len(b) * max(lengths[i] for i in b) <= 80 or len(b) == 1 for b in batches)
    assert batches == plan_batches(lengths, 80)


def test_two_shards_hold_every_sample_once(tmp_path, targets, capsys):
    data = make_conversations_jsonl(tmp_path / "d.jsonl", 14, seed=7)
    store = build_store(tmp_path / "s", targets["llama"], data, shards=2, topk=2)
    assert "running 2 shard(s) on CPU" in capsys.readouterr().out
    s = open_store(store)
    assert s.sample_ids() == list(range(14))
    from dflash.store.layout import load_committed

    for k in range(2):
        idx = load_committed(store / f"shard-0000{k}", s.specs).index
        assert sorted(idx.column("sample_id").to_pylist()) == list(range(k, 14, 2))
    assert verify_store(store).ok


# ---------------------------------------------------------------------------------------------- kill -9


@pytest.mark.slow
def test_kill9_at_three_points_then_resume_gives_the_same_store(tmp_path, targets):
    data = make_conversations_jsonl(tmp_path / "d.jsonl", 20, seed=11)
    opts = dict(target_layers=[0, 2], topk=3, token_budget=256, commit_every_tokens=200, store_chunk_tokens=16)
    ref = build_store(tmp_path / "ref", targets["qwen3"], data, **opts)
    ref_arrays = store_arrays(ref)
    total = len(ref_arrays)

    store = tmp_path / "s"
    params = tmp_path / "params.yaml"
    params.write_text("precompute:\n" + "".join(f"  {k}: {json.dumps(v)}\n" for k, v in opts.items()))
    args = ["--config", str(params), "--target", str(targets["qwen3"]), "--data", str(data), "--out", str(store),
            "--gpus", "cpu", "--max-length", "256"]
    slow = slow_writes(0.15)
    points = [
        lambda: (store / "manifest.json").is_file(),  # right after validation: nothing committed yet
        lambda: committed(store) >= total // 3,  # mid-way
        lambda: committed(store) >= total * 3 // 4,  # near the end
    ]
    seen = []
    for when in points:
        rc, _, family = run_cli(args, env=slow, kill_when=when)
        assert rc == -signal.SIGKILL
        if seen:  # mid-run: the store writer process was running, and died with the shard (checked in _run_cli)
            assert int(family) >= 1
        seen.append(committed(store))
        assert (store / "manifest.json").is_file() and not verify_store(store).ok  # interrupted: never verifies
    assert total // 3 <= seen[1] < seen[2] <= total
    rc, out, err = invoke(args)  # the resuming run in process
    assert rc == 0, err
    assert f"{len(ref_arrays)} samples" in out
    assert store_arrays(store) == Same(ref_arrays)
    assert differing_files(ref, store) == []  # every file, manifest and status included: the same bytes
    res = CliRunner().invoke(main, ["verify", str(store)])
    assert res.exit_code == 0 and "OK" in res.output, res.output
    # a kill inside an atomic write leaves its temporary file; the next run (holding the lock) removes it
    for stray in (store / "parts" / ".part-00000.arrow.tmp-99999", store / ".manifest.json.tmp-99999"):
        stray.write_bytes(b"half")
    res = CliRunner().invoke(main, ["precompute", *args])
    assert res.exit_code == 0 and "already complete" in res.output, res.output
    assert differing_files(ref, store) == []


# ---------------------------------------------------------------------------------------------- bad input


def _cli(*args):
    res = CliRunner().invoke(main, ["precompute", *map(str, args)])
    assert isinstance(res.exception, SystemExit) and res.exit_code != 0, res.output
    assert "Traceback" not in res.output
    return res.output.replace("-\n", "-").replace("\n", " ")  # click wraps lines, also at hyphens


def _no_valid_store(store: Path):
    if store.exists():
        try:
            assert not verify_store(store).ok
        except StoreError:
            pass


@pytest.fixture(scope="module")
def bad(tmp_path_factory, targets):
    d = tmp_path_factory.mktemp("bad")
    good = make_conversations_jsonl(d / "good.jsonl", 4)
    no_tmpl = make_tiny_target(d, arch="llama", chat_template=False, name="notmpl", hidden_size=32, num_layers=2)
    broken = make_tiny_target(d, arch="qwen3", name="broken", hidden_size=32, num_layers=2)
    w = broken / "model.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    return d, good, no_tmpl, broken


def _write(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    "case, expect",
    [
        ("missing_target", r"nowhere"),
        ("broken_weights", r"broken/model.safetensors cannot be read"),
        ("layer_range", r"target layer id\(s\) 9 out of range"),
        ("last_layer", r"include the target's last layer 3 .* --target-layers 0,2 "),
        ("unsorted_layers", r"not in ascending order.* --target-layers 1,2 "),
        ("missing_data", r"nope.jsonl does not exist"),
        ("empty_data", r"empty.jsonl is empty"),
        ("bad_line", r"line 3: not valid JSON"),
        ("unknown_format", r"row 1: unknown conversation format \(fields found: answer, question\)"),
        ("no_template", r"has no chat template"),
        ("no_assistant", r"no assistant turns"),
        # found by the pre-pass, before a store exists, although the first rows render
        ("late_template_reject", r"row 40: the chat template cannot render this conversation .*FORBIDDEN"),
        ("config_more_layers", r"config.json disagrees with the checkpoint's weights: 22 tensor\(s\) the config "
                               r"asks for are not in the weights \(e.g. model.layers.2.input_layernorm.weight\)"),
        ("config_wider", r"config.json disagrees .* 6 tensor\(s\) have another shape in the weights \(e.g. "
                         r"model.layers.\d.mlp.\w+_proj.weight: \[\d+, \d+\] in the files"),
    ],
)
def test_bad_input_fails_cleanly(bad, targets, case, expect):
    d, good, no_tmpl, broken = bad
    target, data = targets["qwen3"], good
    layers = "1,2"
    rows = make_conversations(3)
    if case == "missing_target":
        target = d / "nowhere"
    elif case == "broken_weights":
        target = broken
        layers = "0"
    elif case == "layer_range":
        layers = "1,9"
    elif case == "last_layer":  # the engines cannot feed a drafter the stream after the last layer
        layers = "1,3"
    elif case == "unsorted_layers":
        layers = "2,1"
    elif case == "missing_data":
        data = d / "nope.jsonl"
    elif case == "empty_data":
        data = d / "empty.jsonl"
        data.write_text("")
    elif case == "bad_line":
        data = _write(d / "badline.jsonl", [rows[0], rows[1], '{"messages": [', rows[2]])
    elif case == "unknown_format":
        data = _write(d / "unknown.jsonl", [rows[0], {"question": "q", "answer": "a"}])
    elif case == "no_template":
        target, layers = no_tmpl, "0"
    elif case == "no_assistant":
        data = _write(d / "noasst.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}] * 3)
    elif case == "late_template_reject":
        target = make_tiny_target(d, arch="qwen3", name="picky", hidden_size=32, num_layers=2)
        jinja = target / "chat_template.jinja"
        jinja.write_text("{%- for m in messages %}{%- if 'FORBIDDEN' in m['content'] %}"
                         "{{ raise_exception('FORBIDDEN is not allowed') }}{%- endif %}{%- endfor %}" + jinja.read_text())
        many = make_conversations(60)
        many[40]["messages"][-1]["content"] += " FORBIDDEN"
        data, layers = _write(d / "late.jsonl", many), "0"
    elif case in ("config_more_layers", "config_wider"):
        target = make_tiny_target(d, arch="qwen3", name=case, hidden_size=32, num_layers=2)
        cfg = json.loads((target / "config.json").read_text())
        cfg.update(num_hidden_layers=4, layer_types=["full_attention"] * 4) if case == "config_more_layers" else \
            cfg.update(intermediate_size=2 * cfg["intermediate_size"])
        (target / "config.json").write_text(json.dumps(cfg))
        layers = "0"
    store = d / f"store-{case}"
    out = _cli("--target", target, "--data", data, "--out", store, "--gpus", "cpu", "--target-layers", layers)
    assert out.startswith("error: ")
    assert re.search(expect, out), out
    assert not store.exists(), "bad input must leave nothing behind"
    _no_valid_store(store)


def test_rerun_with_other_inputs_is_refused(tmp_path, targets, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the repository's params.yaml (its pipeline appends) must not apply here
    data = make_conversations_jsonl(tmp_path / "d.jsonl", 6)
    store = build_store(tmp_path / "s", targets["qwen3"], data)
    base = ["--data", data, "--out", store, "--gpus", "cpu", "--max-length", "256", "--topk", "4"]
    out = _cli("--target", targets["llama"], *base, "--target-layers", "1,2")
    assert "target config hash" in out and "--overwrite" in out
    out = _cli("--target", targets["qwen3"], *base, "--target-layers", "0,2")
    assert "target_layer_ids: store has [1, 2], this run has [0, 2]" in out
    other = make_conversations_jsonl(tmp_path / "other.jsonl", 6, seed=4)
    out = _cli("--target", targets["qwen3"], *base, "--target-layers", "1,2", "--data", other)
    assert "another dataset" in out and "--append" in out
    assert verify_store(store).ok  # a refused rerun leaves the store as it was
    res = CliRunner().invoke(main, ["precompute", "--target", str(targets["llama"]), *map(str, base),
                                    "--target-layers", "0,1", "--overwrite"])
    assert res.exit_code == 0, res.output
    s = open_store(store)
    assert s.manifest["target_layer_ids"] == [0, 1] and s.manifest["target"]["model_type"] == "llama"
    # --restart-changed (what dvc.yaml uses): other inputs start over, the same inputs resume (no-op here)
    ok = CliRunner().invoke(main, ["precompute", "--target", str(targets["llama"]), *map(str, base),
                                   "--target-layers", "1,2", "--restart-changed"])
    assert ok.exit_code == 0 and "starting it over" in ok.output, ok.output
    assert open_store(store).manifest["target_layer_ids"] == [1, 2] and verify_store(store).ok
    again = CliRunner().invoke(main, ["precompute", "--target", str(targets["llama"]), *map(str, base),
                                      "--target-layers", "1,2", "--restart-changed"])
    assert again.exit_code == 0 and "already complete" in again.output and "starting it over" not in again.output


def test_a_store_of_other_weights_is_refused(tmp_path, targets, monkeypatch):
    """Same config and tokenizer, other weights, at the same path: the store is not taken as complete
    (a recipe run once trained and decoded against two copies of a target that way)."""
    import shutil

    import transformers

    from dflash.target_model.files import target_identity, weights_fingerprint

    monkeypatch.chdir(tmp_path)
    data = make_conversations_jsonl(tmp_path / "d.jsonl", 6)
    target = tmp_path / "target"
    shutil.copytree(targets["qwen3"], target)
    store = build_store(tmp_path / "s", target, data)
    before = store_arrays(store)
    # the same checkpoint split into several files: the same fingerprint, so the store resumes (no-op)
    model = transformers.AutoModelForCausalLM.from_pretrained(targets["qwen3"])
    resplit = tmp_path / "resplit"
    shutil.copytree(targets["qwen3"], resplit)  # its tokenizer files as they are
    (resplit / "model.safetensors").unlink()
    model.save_pretrained(resplit, max_shard_size="100KB")
    assert len(list(resplit.glob("*.safetensors"))) > 2
    assert weights_fingerprint(resplit) == weights_fingerprint(target)
    base = ["--data", data, "--out", store, "--gpus", "cpu", "--max-length", "256", "--topk", "4", "--target-layers", "1,2"]
    ok = CliRunner().invoke(main, ["precompute", "--target", str(resplit), *map(str, base)])
    assert ok.exit_code == 0 and "already complete" in ok.output, ok.output
    # other weights (another seed), same config and tokenizer, put where the first target was
    other = make_tiny_target(tmp_path, seed=1, name="other")
    assert target_identity(other)["config_hash"] == target_identity(target)["config_hash"]
    shutil.rmtree(target)
    shutil.copytree(other, target)
    out = _cli("--target", target, *base)
    assert "target weights fingerprint" in out and "--overwrite" in out
    for name in ("resume", "append"):
        flag = ["--append"] if name == "append" else []
        out = _cli("--target", target, *base, *flag)
        assert "target weights fingerprint" in out
    assert verify_store(store).ok
    assert Same(store_arrays(store)) == before  # refused runs left every sample as it was


@pytest.mark.slow
def test_a_failing_shard_fails_the_command(tmp_path, targets, monkeypatch):
    import shutil

    import dflash.precompute.badrows as badrows
    from helpers import QWEN3_TEMPLATE

    # a template that refuses one conversation deep in the data, past the rows rendered in full up front;
    # the launcher's row pre-pass (which would catch it before any shard) is switched off here, in this
    # process only, so that the spawned shard meets the row
    monkeypatch.setattr(badrows, "check_renders", lambda *a, **k: True)
    target = tmp_path / "boom-target"
    shutil.copytree(targets["qwen3"], target)
    boom = "{%- for m in messages %}{%- if m.content == 'BOOM' %}{{ raise_exception('BOOM') }}{%- endif %}{%- endfor %}"
    (target / "chat_template.jinja").write_text(boom + QWEN3_TEMPLATE)
    rows = make_conversations(20, seed=1)
    rows[19]["messages"][-2]["content"] = "BOOM"
    data = _write(tmp_path / "d.jsonl", rows)
    store = tmp_path / "s"
    out = _cli("--target", target, "--data", data, "--out", store, "--gpus", "cpu", "--shards", "2", "--target-layers", "1")
    assert re.search(r"error: shard 1 failed: dataset \S+d.jsonl, row 19: the chat template cannot render", out), out
    assert not verify_store(store).ok
