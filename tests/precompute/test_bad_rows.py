"""`precompute --skip-bad-rows`: the store holds the good rows, the report names each bad one (file, line,
reason), a rerun and an --append give the same store; without the flag the command stops naming the row."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dflash.precompute.badrows import REPORT
from dflash.store import open_store, verify_store
from helpers import build_store, make_conversations, make_tiny_target
from processes import run_cli, store_arrays


@pytest.fixture(scope="module")
def picky(tmp_path_factory):
    """A tiny target whose chat template refuses any turn holding FORBIDDEN (as Llama-2-style templates
    refuse turns that do not alternate)."""
    target = make_tiny_target(tmp_path_factory.mktemp("picky"), arch="qwen3", hidden_size=32, num_layers=3)
    jinja = target / "chat_template.jinja"
    jinja.write_text("{%- for m in messages %}{%- if 'FORBIDDEN' in m['content'] %}"
                     "{{ raise_exception('FORBIDDEN is not allowed') }}{%- endif %}{%- endfor %}" + jinja.read_text())
    return target


BAD = {  # line number in the file -> (row, the kind the report gives)
    3: {"conversations": [{"from": "bing", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
    5: {"conversations": []},
    8: {"question": "q", "answer": "a"},
    9: {"messages": [{"role": "user", "content": "say FORBIDDEN"}, {"role": "assistant", "content": "no"}]},
}
KINDS = {3: "unknown role", 5: "no turns", 8: "unknown format", 9: "template refuses"}


def _data(path, good: list[dict], bad: dict[int, dict]):
    rows, it = [], iter(good)
    for line in range(1, len(good) + len(bad) + 1):
        rows.append(bad[line] if line in bad else next(it))
    # blank lines are no rows: the report still gives the file's own line numbers
    path.write_text("\n".join(json.dumps(r) for r in rows[:6]) + "\n\n" + "".join(json.dumps(r) + "\n" for r in rows[6:]))
    return path


def _args(target, data, store, *more):
    return ["--target", target, "--data", data, "--out", store, "--gpus", "cpu", "--target-layers", "1",
            "--topk", "2", "--max-length", "128", *more]


def test_without_the_flag_the_first_bad_row_stops_the_run(tmp_path, picky):
    data = _data(tmp_path / "d.jsonl", make_conversations(8), BAD)
    rc, out, err = run_cli(_args(picky, data, tmp_path / "s"))
    assert rc != 0 and "Traceback" not in err
    assert "row 2: conversations[0] has from='bing'" in err and "--skip-bad-rows" in err, err
    assert not (tmp_path / "s").exists()


@pytest.mark.slow
def test_bad_rows_are_left_out_listed_and_a_rerun_and_an_append_keep_the_store(tmp_path, picky):
    good = make_conversations(8, seed=3)
    data = _data(tmp_path / "d.jsonl", good, BAD)
    store = tmp_path / "s"
    rc, out, err = run_cli(_args(picky, data, store, "--skip-bad-rows"))
    assert rc == 0, err
    assert f"left out 4 bad rows (--skip-bad-rows; listed in {store / REPORT})" in out, out
    report = [json.loads(x) for x in (store / REPORT).read_text().split("\n") if x]
    line_of = {3: 3, 5: 5, 8: 9, 9: 10}  # the blank line after line 6 shifts the later ones
    assert [(r["part"], r["line"], r["kind"], r["file"]) for r in report] == \
        [(0, line_of[n], KINDS[n], str(data)) for n in sorted(BAD)]
    assert all(f"row {r['row']}" in r["reason"] for r in report)
    s = open_store(store)
    assert s.manifest["parts"][0]["bad_rows"] == 4 and len(s) == 8 and verify_store(store).ok
    # the same store as one captured from the good rows alone (sample ids aside: they follow the rows)
    ref = build_store(tmp_path / "ref", picky, _data(tmp_path / "g.jsonl", good, {}), target_layers=[1], topk=2,
                      max_length=128)
    got, want = store_arrays(store), store_arrays(ref)
    for a, b in zip(sorted(got), sorted(want)):
        assert all(np.array_equal(got[a][k], want[b][k]) for k in want[b])
    before = (store / REPORT).read_bytes()
    rc, out, err = run_cli(_args(picky, data, store, "--skip-bad-rows"))
    assert rc == 0 and "already complete" in out, err
    assert store_arrays(store).keys() == got.keys() and (store / REPORT).read_bytes() == before

    grown = _data(tmp_path / "grown.jsonl", good + make_conversations(2, seed=9), {**BAD, 12: {"messages": []}})
    rc, out, err = run_cli(_args(picky, grown, store, "--skip-bad-rows", "--append"))
    assert rc == 0, err
    report = [json.loads(x) for x in (store / REPORT).read_text().split("\n") if x]
    assert [r["part"] for r in report] == [0] * 4 + [1] * 5 and report[-1]["kind"] == "no turns"
    assert len(open_store(store)) == 10 and open_store(store).manifest["parts"][1]["bad_rows"] == 5


@pytest.mark.slow
def test_a_line_that_is_not_one_json_object_is_a_bad_row(tmp_path, picky):
    """A line cut by a crashed writer and a bare JSON value: with --skip-bad-rows each is one more bad row
    (listed with its file, line and kind, counted) and the rows after it keep their numbers; once the cut
    line is fixed, an --append captures that conversation alone."""
    good = make_conversations(6, seed=5)
    cut = json.dumps(good[2])[:40]
    lines = [json.dumps(r) for r in good[:2]] + [cut, "[1, 2]"] + [json.dumps(r) for r in good[3:]]
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(lines) + "\n")
    store = tmp_path / "s"
    rc, out, err = run_cli(_args(picky, data, store))
    assert rc != 0 and "line 3: not valid JSON" in err and "Fix or delete that line" in err and "Traceback" not in err
    assert not store.exists()

    rc, out, err = run_cli(_args(picky, data, store, "--skip-bad-rows"))
    assert rc == 0, err
    assert f"left out 2 bad rows (--skip-bad-rows; listed in {store / REPORT})" in out, out
    report = [json.loads(x) for x in (store / REPORT).read_text().split("\n") if x]
    assert [(r["row"], r["line"], r["kind"], r["file"]) for r in report] == \
        [(2, 3, "not valid JSON", str(data)), (3, 4, "not a JSON object", str(data))]
    assert "not valid JSON (" in report[0]["reason"] and "a JSON list" in report[1]["reason"]
    s = open_store(store)
    assert len(s) == 5 and s.manifest["parts"][0]["bad_rows"] == 2 and verify_store(store).ok
    ref = build_store(tmp_path / "ref", picky, _data(tmp_path / "g.jsonl", good[:2] + good[3:], {}),
                      target_layers=[1], topk=2, max_length=128)
    got, want = store_arrays(store), store_arrays(ref)
    for a, b in zip(sorted(got), sorted(want)):
        assert all(np.array_equal(got[a][k], want[b][k]) for k in want[b])

    lines[2] = json.dumps(good[2])
    data.write_text("\n".join(lines) + "\n")
    rc, out, err = run_cli(_args(picky, data, store, "--skip-bad-rows", "--append"))
    assert rc == 0, err
    s = open_store(store)
    assert len(s) == 6 and s.manifest["parts"][1]["bad_rows"] == 1 and verify_store(store).ok
    report = [json.loads(x) for x in (store / REPORT).read_text().split("\n") if x]
    assert [(r["part"], r["line"]) for r in report] == [(0, 3), (0, 4), (1, 4)]
