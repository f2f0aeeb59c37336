"""Records written by precompute, train and eval carry no absolute path of the machine (issue: a store or
run shared with other users), and stay usable when the whole tree is moved: paths are kept relative to
the directory each record describes (dflash/paths.py)."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from dflash.cli import main
from helpers import make_conversations_jsonl, make_tiny_target


def _cli(*args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    return r.output


def _records(root):
    return [p for p in root.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl", ".arrow", ".yaml")]


@pytest.mark.slow  # a precompute, two training steps and an eval on CPU (~15 s)
def test_records_hold_no_absolute_paths_and_survive_a_move(tmp_path, monkeypatch):
    from dflash.paths import from_record, portable

    a = tmp_path / "machine-a"
    a.mkdir()
    monkeypatch.chdir(a)
    make_tiny_target(a, name="target")
    make_conversations_jsonl(a / "chats.jsonl", 12)
    _cli("precompute", "--target", "target", "--data", "chats.jsonl", "--out", "store", "--gpus", "cpu",
         "--max-length", "128", "--topk", "2", "--target-layers", "1,2")
    _cli("train", "--store", "store", "--target", "target", "--out", "run", "--gpus", "cpu:1", "--block-size", "4",
         "--steps", "2", "--token-budget", "128", "--num-anchors", "4", "--num-workers", "1", "--compile", "off",
         "--warmup-steps", "1", "--save-every", "2")
    _cli("eval", "--run", "run", "--store", "store", "--out", "eval.json", "--device", "cpu")
    for f in _records(a):
        assert str(tmp_path).encode() not in f.read_bytes(), f  # no path of this machine, in any record
    manifest = json.loads((a / "store" / "manifest.json").read_text())
    assert manifest["dataset"]["path"] == "../chats.jsonl" and manifest["target"]["path"] == "../target"
    assert json.loads((a / "run" / "config.json").read_text())["store"]["path"] == "../store"

    b = tmp_path / "machine-b" / "elsewhere"  # another machine, another user: the tree moved as a whole
    b.parent.mkdir()
    shutil.move(a, b)
    monkeypatch.chdir(b.parent)
    # the target named as typed at train time (relative to a working directory that is gone) is not found;
    # eval finds it through the run's and the store's records instead
    out = _cli("eval", "--run", "elsewhere/run", "--store", "elsewhere/store", "--out", "elsewhere/eval2.json",
               "--device", "cpu")
    assert json.loads((b / "eval2.json").read_text())["target"] == "elsewhere/target", out
    assert portable("/x/y/z", "/x/w") == "../y/z" and str(from_record("../y/z", "/x/w")) == "/x/y/z"
    assert str(from_record("/abs/p", "/x")) == "/abs/p"  # records written before stay readable
