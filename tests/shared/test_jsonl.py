"""JSON lines end at "\\n" only: characters that str.splitlines also breaks at survive every JSONL reader."""

from __future__ import annotations

import json

import pytest

from dflash.chat import conversation_of, load_rows
from dflash.jsonl import jsonl_lines
from dflash.train.preflight import truncate_metrics

# Each one is a line break to str.splitlines; the first three may stand raw inside a JSON string.
BREAKERS = ["\u2028", "\u2029", "\x85", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e"]


def test_lines_split_at_newline_only_and_drop_a_trailing_cr():
    text = "".join(f'{{"a": "x{c}y"}}\r\n' for c in BREAKERS)
    assert jsonl_lines(text) == [f'{{"a": "x{c}y"}}' for c in BREAKERS]
    assert jsonl_lines(text.encode()) == [f'{{"a": "x{c}y"}}'.encode() for c in BREAKERS]
    assert jsonl_lines("a\n\nb") == ["a", "", "b"] and jsonl_lines("") == []


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_rows_holding_any_line_breaking_character_load_as_written(tmp_path, newline):
    rows = [{"conversations": [{"from": "human", "value": f"line{c}break {i}"}, {"from": "gpt", "value": f"ok{c}"}]}
            for i, c in enumerate(BREAKERS)]
    p = tmp_path / "chats.jsonl"
    p.write_bytes("".join(json.dumps(r, ensure_ascii=False) + newline for r in rows).encode())
    assert "\u2028" in p.read_text(encoding="utf-8")  # raw, as ShareGPT dumps hold it
    ds = load_rows(p)
    assert len(ds) == len(BREAKERS)
    for i, c in enumerate(BREAKERS):
        assert conversation_of(ds[i], i, p)[0]["content"] == f"line{c}break {i}"


def test_metrics_records_holding_them_survive_a_resume_cut(tmp_path):
    p = tmp_path / "metrics.jsonl"
    recs = [{"step": i + 1, "loss": 1.0, "note": f"a{c}b"} for i, c in enumerate(BREAKERS)]
    p.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs) + '{"step": 9, "lo', encoding="utf-8")
    assert truncate_metrics(p, 5) == recs[:5]
    assert [json.loads(x) for x in jsonl_lines(p.read_text(encoding="utf-8"))] == recs[:5]
