"""`precompute --skip-bad-rows`: the store holds the good rows, the report names each bad one (file, line,
reason), a rerun and an --append give the same store; without the flag the command stops naming the row."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dflash.precompute.badrows import REPORT
from dflash.store import open_store, verify_store
from helpers import build_store, make_conversations, make_tiny_target
from processes import invoke, run_cli, store_arrays


@pytest.fixture(scope="module")
def picky(tmp_path_factory):
    """A tiny target whose chat template refuses any turn holding FORBIDDEN (as Llama-2-style templates
    refuse turns that do not alternate)."""
    target = make_tiny_target(tmp_path_factory.mktemp("picky"), arch="qwen3", hidden_size=32, num_layers=3)
    jinja = target / "chat_template.jinja"
    jinja.write_text("{%- for m in messages %}{%- if 'FORBIDDEN' in m['content'] %}"
                     "{{ raise_exception('FORBIDDEN is not allowed') }}{%- endif %}{%- endfor %}" + jinja.read_text())
    return target


BAD = {  # line number in the file -> row
    3: {"conversations": [{"from": "bing", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
    5: {"conversations": []},
    8: {"question": "q", "answer": "a"},
    9: {"messages": [{"role": "user", "content": "say FORBIDDEN"}, {"role": "assistant", "content": "no"}]},
}
KINDS = {3: "unknown role", 5: "no turns", 8: "unknown format", 9: "template refuses", 11: "not a JSON object",
         12: "not valid JSON"}
NOT_AN_OBJECT, CUT_AT = 11, 12  # lines that are not one JSON object: a bare JSON value, a line a crashed writer cut


def _line(r) -> str:
    return r if isinstance(r, str) else json.dumps(r)


def _data(path, good: list[dict], bad: dict[int, dict | str]):
    """`good` with `bad` at its line numbers (a str: the line as it stands)."""
    rows, it = [], iter(good)
    for line in range(1, len(good) + len(bad) + 1):
        rows.append(bad[line] if line in bad else next(it))
    # blank lines are no rows: the report still gives the file's own line numbers
    path.write_text("\n".join(map(_line, rows[:6])) + "\n\n" + "".join(_line(r) + "\n" for r in rows[6:]))
    return path


def _args(target, data, store, *more):
    return ["--target", target, "--data", data, "--out", store, "--gpus", "cpu", "--target-layers", "1",
            "--topk", "2", "--max-length", "128", *more]


def _report(store) -> list[dict]:
    return [json.loads(x) for x in (store / REPORT).read_text().split("\n") if x]


def test_without_the_flag_the_first_bad_row_stops_the_run(tmp_path, picky):
    data = _data(tmp_path / "d.jsonl", make_conversations(8), BAD)
    rc, out, err = invoke(_args(picky, data, tmp_path / "s"))
    assert rc == 1 and "row 2: conversations[0] has from='bing'" in err and "--skip-bad-rows" in err, err
    assert not (tmp_path / "s").exists()
    # a line cut by a crashed writer is named by its line, with what to do
    good = make_conversations(6, seed=5)
    cut = tmp_path / "cut.jsonl"
    cut.write_text("\n".join([json.dumps(r) for r in good[:2]] + [json.dumps(good[2])[:40]] +
                              [json.dumps(r) for r in good[3:]]) + "\n")
    rc, out, err = invoke(_args(picky, cut, tmp_path / "s2"))
    assert rc == 1 and "line 3: not valid JSON" in err and "Fix or delete that line" in err, err
    assert not (tmp_path / "s2").exists()


@pytest.mark.slow
def test_bad_rows_are_left_out_listed_and_a_rerun_and_an_append_keep_the_store(tmp_path, picky):
    """Every kind of bad row, a line that is not one JSON object among them (a bare JSON value, a line cut by
    a crashed writer): each is left out, listed with its file, line and kind, and counted, and the rows after
    it keep their numbers; a rerun changes nothing; an --append of grown data whose cut line was fixed
    captures the new conversations and that one alone."""
    good = make_conversations(8, seed=3)
    cut = make_conversations(1, seed=5)[0]
    bad = {**BAD, NOT_AN_OBJECT: "[1, 2]", CUT_AT: json.dumps(cut)[:40]}
    data = _data(tmp_path / "d.jsonl", good, bad)
    store = tmp_path / "s"
    rc, out, err = run_cli(_args(picky, data, store, "--skip-bad-rows"))
    assert rc == 0, err
    assert f"left out 6 bad rows (--skip-bad-rows; listed in {store / REPORT})" in out, out
    report = _report(store)
    line_of = {n: n + (n > 6) for n in bad}  # the blank line after line 6 shifts the later ones
    assert [(r["part"], r["row"], r["line"], r["kind"], r["file"]) for r in report] == \
        [(0, n - 1, line_of[n], KINDS[n], str(data)) for n in sorted(bad)]
    assert all(f"row {r['row']}" in r["reason"] for r in report)
    assert "a JSON list" in report[-2]["reason"] and "not valid JSON (" in report[-1]["reason"]
    s = open_store(store)
    assert s.manifest["parts"][0]["bad_rows"] == 6 and len(s) == 8 and verify_store(store).ok
    # the same store as one captured from the good rows alone (sample ids aside: they follow the rows)
    ref = build_store(tmp_path / "ref", picky, _data(tmp_path / "g.jsonl", good, {}), target_layers=[1], topk=2,
                      max_length=128)
    got, want = store_arrays(store), store_arrays(ref)
    assert len(got) == len(want)
    for a, b in zip(sorted(got), sorted(want)):
        assert all(np.array_equal(got[a][k], want[b][k]) for k in want[b])
    before = (store / REPORT).read_bytes()
    rc, out, err = invoke(_args(picky, data, store, "--skip-bad-rows"))  # the reruns in process
    assert rc == 0 and "already complete" in out, err
    assert store_arrays(store).keys() == got.keys() and (store / REPORT).read_bytes() == before

    grown = _data(tmp_path / "grown.jsonl", good + make_conversations(2, seed=9),
                  {**bad, CUT_AT: cut, 14: {"messages": []}})
    rc, out, err = invoke(_args(picky, grown, store, "--skip-bad-rows", "--append"))
    assert rc == 0, err
    report = _report(store)
    assert [r["part"] for r in report] == [0] * 6 + [1] * 6, report
    assert [r["kind"] for r in report[6:]] == [KINDS[n] for n in [*sorted(BAD), NOT_AN_OBJECT]] + ["no turns"]
    s = open_store(store)
    assert len(s) == 11 and s.manifest["parts"][1]["bad_rows"] == 6 and verify_store(store).ok


def test_the_pre_pass_in_worker_processes_gives_what_it_gives_in_this_one(tmp_path, picky):
    """check_rows with 2 spawned workers (pieces of PIECE_ROWS rows travelling to them) and inline: the same
    keys, the same bad rows and reasons, the same held rows skipped; without --skip-bad-rows the same first
    bad row stops both. More rows than a piece, so the order of pieces counts."""
    from dflash.chat import conversation_key, conversation_of, read_rows
    from dflash.config import PrecomputeConfig
    from dflash.errors import RowError
    from dflash.precompute import badrows
    from dflash.target_model.capture import load_tokenizer

    good = make_conversations(badrows.PIECE_ROWS + 40, seed=3)
    late = {badrows.PIECE_ROWS + 20: BAD[9], badrows.PIECE_ROWS + 30: BAD[3]}
    data = _data(tmp_path / "d.jsonl", good, {**BAD, NOT_AN_OBJECT: "[1, 2]", **late})
    tok = load_tokenizer(str(picky), False)
    ds, broken = read_rows(data, "train", None, skip_bad_lines=True)
    held = {conversation_key(conversation_of(ds[i], i, str(data))) for i in (0, 1, badrows.PIECE_ROWS + 5)}
    cfg = PrecomputeConfig(target=str(picky), data=str(data), out=str(tmp_path / "s"), skip_bad_rows=True)
    inline = badrows.check_rows(cfg, ds, tok, held, broken, workers=0)
    pooled = badrows.check_rows(cfg, ds, tok, held, broken, workers=2)
    assert pooled == inline
    keys, bad = inline
    assert len(keys) == len(ds) and sum(k is None for k in keys) == len(bad) == len(BAD) + 1 + len(late)
    assert {b["kind"] for b in bad} == {"unknown role", "no turns", "unknown format", "template refuses",
                                        "not a JSON object"}
    strict = PrecomputeConfig(target=str(picky), data=str(data), out=str(tmp_path / "s"), skip_bad_rows=False)
    errors = []
    for workers in (0, 2):
        with pytest.raises(RowError) as e:
            badrows.check_rows(strict, ds, tok, held, broken, workers=workers)
        errors.append(str(e.value))
    assert errors[0] == errors[1] and "row 2:" in errors[0]
