"""Rows planned and written back in their own format; the journal's torn tail and the output's bytes."""

from __future__ import annotations

import json

import pytest

from dflash.chat import conversation_of
from dflash.errors import DataError, GenerateError
from dflash.generate import journal as jr
from dflash.generate.endpoint import base_url, join_reasoning
from dflash.generate.rows import apply_response, plan_row, prompt_messages, write_back
from helpers import make_conversations


def regenerate(row, turns, answer=lambda i: f"new {i}"):
    plan = plan_row(row, 0, "x.jsonl", turns)
    msgs = plan.messages
    for t in plan.turns:
        msgs = apply_response(msgs, t, answer(t))
    return plan, write_back(row, plan, msgs)


@pytest.mark.parametrize("fmt", ["messages", "sharegpt", "prompt"])
def test_every_format_is_written_back_in_its_own_format(fmt):
    for row in make_conversations(6, fmt=fmt):
        plan, out = regenerate(row, "all")
        assert set(out) == set(row)  # same fields, same format
        before, after = conversation_of(row, 0, "x"), conversation_of(out, 0, "x")
        assert [m["role"] for m in after] == [m["role"] for m in before]
        for i, (a, b) in enumerate(zip(before, after)):
            assert b["content"] == (f"new {i}" if a["role"] == "assistant" else a["content"])
        _, same = regenerate(row, "none")
        assert same == row


def test_last_replaces_only_the_last_turn_and_all_sees_its_own_earlier_turns():
    row = make_conversations(2)[1]  # two user/assistant exchanges
    plan, out = regenerate(row, "last")
    roles = [m["role"] for m in row["messages"]]
    assert plan.turns == [len(roles) - 1]
    assert out["messages"][:-1] == row["messages"][:-1] and out["messages"][-1]["content"] == f"new {len(roles) - 1}"
    plan = plan_row(row, 0, "x", "all")
    msgs = apply_response(plan.messages, plan.turns[0], "mine")
    assert prompt_messages(msgs, plan.turns[1])[plan.turns[0]]["content"] == "mine"


def test_a_conversation_ending_with_the_user_gets_an_answer_appended():
    row = {"conversations": [{"from": "human", "value": "hi"}]}
    plan, out = regenerate(row, "last")
    assert out["conversations"] == [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "new 1"}]
    row = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]}
    assert regenerate(row, "all")[1]["messages"][-1] == {"role": "assistant", "content": "new 2"}


def test_rows_without_a_prompt_are_refused_naming_the_row():
    with pytest.raises(DataError, match="row 0: assistant turn 0 has no user turn"):
        plan_row({"messages": [{"role": "assistant", "content": "a"}]}, 0, "x.jsonl", "all")
    with pytest.raises(DataError, match="row 0: unknown conversation format"):
        plan_row({"text": "a"}, 0, "x.jsonl", "all")


def test_the_journal_drops_a_torn_last_line_and_refuses_a_damaged_one(tmp_path):
    j = jr.Journal(tmp_path, 0)
    j.append([{"row": 0, "out": {"a": 1}}, {"row": 1, "out": {"a": 2}}])
    j.close()
    with open(j.path, "ab") as f:
        f.write(b'{"row": 2, "out": {"a"')  # what a kill -9 in the middle of a write leaves
    assert sorted(jr.load_records(tmp_path)) == [0, 1]
    j = jr.Journal(tmp_path, 0)  # reopening cuts the torn line off before appending
    j.append([{"row": 2, "out": {"a": 3}}])
    j.close()
    assert sorted(jr.load_records(tmp_path)) == [0, 1, 2]
    assert jr.output_bytes(jr.load_records(tmp_path), 4) == b'{"a": 1}\n{"a": 2}\n{"a": 3}\n'
    j.path.write_bytes(b'{"row": 0}\nnot json\n{"row": 1}\n')
    with pytest.raises(GenerateError, match="line 2, is damaged"):
        jr.load_records(tmp_path)


def test_reasoning_returned_apart_is_put_back_in_the_turn():
    assert join_reasoning("42", "think hard") == "<think>\nthink hard\n</think>\n\n42"
    assert join_reasoning("<think>\nx\n</think>\n\n42", "x") == "<think>\nx\n</think>\n\n42"
    assert join_reasoning("42", None) == "42"
    assert base_url("http://h:1") == base_url("http://h:1/v1/") == base_url("http://h:1/v1/chat/completions") \
        == "http://h:1/v1"


def test_output_keeps_unicode_and_is_one_json_object_per_line():
    data = jr.output_bytes({0: {"row": 0, "out": {"messages": [{"role": "user", "content": "é\n"}]}}}, 1)
    assert data.decode().count("\n") == 1 and json.loads(data)["messages"][0]["content"] == "é\n"


def test_the_journal_holding_any_unicode_resumes_byte_for_byte(tmp_path):
    texts = ["\u2028", "\u2029", "\x85", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\r", "\u202e\u05e9\u05dc",
             "\U0001f600", "\x00", "\ud7ff\ue000\uffff"]
    recs = [{"row": i, "out": {"messages": [{"role": "user", "content": f"a{t}b"}]}} for i, t in enumerate(texts)]
    j = jr.Journal(tmp_path, 0)
    j.append(recs[:7])
    j.close()
    with open(j.path, "ab") as f:
        f.write(json.dumps(recs[7], ensure_ascii=False).encode()[:-3])  # torn by a kill -9
    j = jr.Journal(tmp_path, 0)  # the resume: the torn tail cut off, every whole record kept
    j.append(recs[7:])
    j.close()
    got = jr.load_records(tmp_path)
    assert [got[i] for i in range(len(texts))] == recs
    want = b"".join(json.dumps(r["out"], ensure_ascii=False).encode() + b"\n" for r in recs)
    assert jr.output_bytes(got, len(texts)) == want
