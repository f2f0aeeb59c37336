"""`dflash precompute --append`: a grown dataset adds only its new conversations, as a new part; committed
samples are never rewritten; kill -9 during an append then a rerun gives the store an uninterrupted
append gives; an append with other capture settings is refused, naming the difference."""

from __future__ import annotations

import json
import random
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from dflash.chat import conversation_of, load_rows, render
from dflash.cli import main
from dflash.store import open_store, verify_store
from dflash.store.parts import part_path, part_rows
from dflash.target_model.capture import load_tokenizer
from helpers import build_store, make_conversations, make_tiny_target
from processes import Same, committed, invoke, run_cli, slow_writes, store_arrays

OPTS = dict(commit_every_tokens=200, store_chunk_tokens=16, token_budget=256)


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _stored(store: Path, shard: str) -> int:
    """Samples a shard holds: its finished index, or the segments committed so far."""
    final = store / shard / "index.arrow"
    if final.is_file():
        import pyarrow as pa

        try:
            with pa.memory_map(str(final)) as src:
                return pa.ipc.open_file(src).read_all().num_rows
        except (OSError, pa.ArrowInvalid):
            return 0
    return committed(store, shard)


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file() and p.name != ".lock"}


@pytest.fixture(scope="module")
def grown(tmp_path_factory):
    """A store of 16 conversations (one repeated), then the dataset grown: reordered, 14 new interleaved,
    one of them repeated, in another file; appended with 2 shards."""
    d = tmp_path_factory.mktemp("append")
    target = make_tiny_target(d, arch="qwen3")
    rows = make_conversations(30, seed=3)
    first = _jsonl(d / "first.jsonl", rows[:16] + [rows[0]])
    later = rows[:16]
    random.Random(0).shuffle(later)
    mixed = []
    for i, r in enumerate(rows[16:]):  # new rows interleaved with the reordered old ones
        mixed += later[i : i + 1] + [r]
    mixed += later[14:] + [rows[20]]
    second = _jsonl(d / "second.jsonl", mixed)
    base = build_store(d / "base", target, first, **OPTS)
    before = _files(base / "shard-00000")
    store = d / "store"
    shutil.copytree(base, store)
    build_store(store, target, second, append=True, shards=2, **OPTS)
    return dict(dir=d, target=target, rows=rows, first=first, second=second, base=base, store=store, before=before)


def test_append_adds_only_the_new_conversations(grown):
    store, second = grown["store"], grown["second"]
    s = open_store(store, require_complete=True)
    parts = s.manifest["parts"]
    assert [p["num_shards"] for p in parts] == [1, 2] and s.manifest["num_shards"] == 3
    assert (parts[0]["new"], parts[0]["duplicates"], parts[0]["already_stored"]) == (16, 1, 0)
    assert (parts[1]["new"], parts[1]["duplicates"], parts[1]["already_stored"]) == (14, 1, 16)
    assert parts[1]["id_base"] == 17 and parts[1]["dataset_fingerprint"] != parts[0]["dataset_fingerprint"]
    assert len(s) == 30
    # committed samples were never rewritten: part 0's shard is byte for byte what it was
    assert _files(store / "shard-00000") == grown["before"]
    # every conversation once, new ones at their row of the grown file, each sample what its row renders
    tok = load_tokenizer(grown["target"])
    ds = load_rows(second)
    rendered = {}
    for sid in s.sample_ids():
        i = s._locate(sid)
        row = int(s.index.column("source_row")[i].as_py())
        if sid >= 17:
            rd = render(tok, conversation_of(ds[row], row, second), 256)
            assert s.read(sid, fields=["input_ids"])["input_ids"].tolist() == rd.input_ids
        rendered[sid] = tuple(s.read(sid, fields=["input_ids"])["input_ids"].tolist())
    want = {tuple(render(tok, conversation_of(r, 0, "x"), 256).input_ids) for r in grown["rows"]}
    assert set(rendered.values()) == want and len(rendered) == len(want)
    assert sorted(part_rows(store, 1).tolist()) == part_rows(store, 1).tolist()
    assert verify_store(store).ok


def test_new_samples_match_a_store_of_only_them(grown, tmp_path):
    """The appended part's capture equals a fresh precompute of the new conversations."""
    only = _jsonl(tmp_path / "only.jsonl", grown["rows"][16:])
    fresh = store_arrays(build_store(tmp_path / "fresh", grown["target"], only, **OPTS))
    by_ids = {tuple(v["input_ids"].tolist()): v for v in fresh.values()}
    got = store_arrays(grown["store"])
    new = [v for sid, v in got.items() if sid >= 17]
    assert len(new) == 14
    for v in new:
        ref = by_ids[tuple(v["input_ids"].tolist())]
        assert np.array_equal(v["loss_mask"], ref["loss_mask"]) and np.array_equal(v["topk_ids"][:, 0], ref["topk_ids"][:, 0])
        h, r = (np.frombuffer(x["hidden"].tobytes(), dtype=np.uint16).astype(np.uint32) << 16 for x in (v, ref))
        assert np.allclose(h.view(np.float32), r.view(np.float32), atol=2e-2, rtol=2e-2)


def test_a_second_append_of_the_same_data_adds_nothing(grown, tmp_path):
    store = tmp_path / "s"
    shutil.copytree(grown["store"], store)
    before = _files(store)
    args = ["precompute", "--target", grown["target"], "--data", grown["second"], "--out", store, "--gpus", "cpu",
            "--max-length", "256", "--topk", "4", "--target-layers", "1,2", "--append", "--restart-changed"]
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == 0 and "nothing to add" in res.output and "starting it over" not in res.output, res.output
    res = CliRunner().invoke(main, [str(a) for a in args[:-2]])  # the grown file, without --append: resumes (no-op)
    assert res.exit_code == 0 and "already complete" in res.output, res.output
    assert _files(store) == before


def test_a_pipeline_rerun_with_grown_data_appends_instead_of_starting_over(grown, tmp_path):
    """`--append --restart-changed` (what dvc.yaml runs): grown data grows the store; nothing is recaptured."""
    store = tmp_path / "s"
    shutil.copytree(grown["base"], store)
    args = ["precompute", "--target", grown["target"], "--data", grown["second"], "--out", store, "--gpus", "cpu",
            "--max-length", "256", "--topk", "4", "--target-layers", "1,2", "--append", "--restart-changed",
            "--commit-every-tokens", "200", "--store-chunk-tokens", "16", "--token-budget", "256"]
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == 0 and "starting it over" not in res.output and "14 new conversations" in res.output, \
        res.output
    assert _files(store / "shard-00000") == grown["before"] and len(open_store(store)) == 30


@pytest.mark.parametrize("flag, value, names", [
    ("--target-layers", "0,2", "target_layer_ids: store has [1, 2], this run has [0, 2]"),
    ("--topk", "3", "topk: store has 4, this run has 3"),
    ("--hidden-dtype", "fp8", "hidden_dtype: store has 'bf16', this run has 'fp8'"),
    ("--max-length", "128", "max_length: store has 256, this run has 128"),
])
def test_an_append_with_other_settings_is_refused(grown, flag, value, names):
    base = {"--target-layers": "1,2", "--topk": "4", "--hidden-dtype": "bf16", "--max-length": "256", flag: value}
    args = ["precompute", "--target", grown["target"], "--data", grown["second"], "--out", grown["base"],
            "--gpus", "cpu", "--append", *[x for kv in base.items() for x in kv]]
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code != 0 and "Traceback" not in res.output
    assert names in res.output.replace("\n", " "), res.output
    assert not part_path(grown["base"], 1).exists()


def test_an_append_with_another_target_is_refused(grown, tmp_path):
    other = make_tiny_target(tmp_path, arch="llama")
    args = ["precompute", "--target", other, "--data", grown["second"], "--out", grown["base"], "--gpus", "cpu",
            "--max-length", "256", "--topk", "4", "--target-layers", "1,2", "--append"]
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code != 0 and "target config hash" in res.output and not part_path(grown["base"], 1).exists()


@pytest.mark.slow
def test_kill9_during_an_append_at_three_points_then_rerun(grown, tmp_path):
    """One shard for the append here (each shard process of a killed run must start and notice its
    launcher's death); the two-shard append is the fixture's."""
    ref = tmp_path / "ref"
    shutil.copytree(grown["base"], ref)
    build_store(ref, grown["target"], grown["second"], append=True, **OPTS)
    store = tmp_path / "s"
    shutil.copytree(grown["base"], store)
    def new(n):
        return lambda: _stored(store, "shard-00001") >= n

    args = ["--target", grown["target"], "--data", grown["second"], "--out", store, "--gpus", "cpu",
            "--max-length", "256", "--topk", "4", "--target-layers", "1,2", "--append",
            "--commit-every-tokens", "200", "--store-chunk-tokens", "16", "--token-budget", "256"]
    points = [
        lambda: part_path(store, 1).is_file(),  # the part is recorded, no shard has committed
        new(3),  # early in the new shards
        new(10),  # near their end (14 new conversations)
    ]
    for n, when in enumerate(points):
        rc, _, _ = run_cli(args, env=slow_writes(0.3), kill_when=when)
        assert rc == -signal.SIGKILL
        assert _files(store / "shard-00000") == grown["before"]  # never touched by the append
        if n == 0:  # an unfinished part is finished first, from its own dataset: another one is refused
            other = _jsonl(tmp_path / "other.jsonl", make_conversations(4, seed=99))
            res = CliRunner().invoke(main, ["precompute", *map(str, args[:3]), str(other), *map(str, args[4:])])
            assert res.exit_code != 0 and "part 1" in res.output and "interrupted" in res.output, res.output
    rc, out, err = invoke(args)  # the resuming run in process
    assert rc == 0, err
    assert store_arrays(store) == Same(store_arrays(ref))
    assert part_rows(store, 1).tolist() == part_rows(ref, 1).tolist() == part_rows(grown["store"], 1).tolist()
    assert verify_store(store).ok
