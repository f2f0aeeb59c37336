"""Dataset reading, conversation formats and assistant loss masks for Qwen3- and Llama-3-like templates."""

from __future__ import annotations

import json

import pytest

from dflash.chat import conversation_of, dataset_fingerprint, load_rows, render
from dflash.errors import DataError
from helpers import make_conversations, make_conversations_jsonl, make_tokenizer


@pytest.fixture(scope="module")
def qwen():
    return make_tokenizer("qwen3")


@pytest.fixture(scope="module")
def llama():
    return make_tokenizer("llama")


def supervised_text(tok, r):
    """The supervised stretches of a render, decoded, one string per contiguous run."""
    runs, cur = [], []
    for t, m in zip(r.input_ids, r.loss_mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


MULTI = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "say the world"},
    {"role": "assistant", "content": "the world is good"},
    {"role": "user", "content": "and now"},
    {"role": "assistant", "content": "now it is not"},
]


def test_qwen3_masks_content_and_im_end_not_header(qwen):
    r = render(qwen, MULTI, 4096)
    assert supervised_text(qwen, r) == [
        "the world is good<|im_end|>",
        # the last turn: the template forces an (empty) think block, which the model generates itself
        "<think>\n\n</think>\n\nnow it is not<|im_end|>",
    ]
    assert not r.truncated
    full = qwen.apply_chat_template(MULTI, tokenize=False)
    assert qwen.decode(r.input_ids) == full
    # the role header and the newline after <|im_end|> are never supervised
    im_start = qwen.convert_tokens_to_ids("<|im_start|>")
    assert all(m == 0 for t, m in zip(r.input_ids, r.loss_mask) if t == im_start)
    im_end = qwen.convert_tokens_to_ids("<|im_end|>")
    ends = [m for t, m in zip(r.input_ids, r.loss_mask) if t == im_end]
    assert ends == [0, 0, 1, 0, 1]  # system, user, assistant, user, assistant


def test_qwen3_earlier_think_is_stripped_fallback(qwen):
    msgs = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "<think>\nlet me see\n</think>\n\nthe answer"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "<think>\nagain\n</think>\n\nmore words"},
    ]
    r = render(qwen, msgs, 4096)
    # the earlier turn's reasoning is not in the render (the template drops it): content + <|im_end|> only
    assert supervised_text(qwen, r) == ["the answer<|im_end|>", "<think>\nagain\n</think>\n\nmore words<|im_end|>"]


def test_llama3_masks_content_and_eot(llama):
    r = render(llama, MULTI, 4096)
    assert supervised_text(llama, r) == ["the world is good<|eot_id|>", "now it is not<|eot_id|>"]
    hdr = llama.convert_tokens_to_ids("<|start_header_id|>")
    assert all(m == 0 for t, m in zip(r.input_ids, r.loss_mask) if t == hdr)
    assert r.input_ids[0] == llama.convert_tokens_to_ids("<|begin_of_text|>") and r.loss_mask[0] == 0


def test_llama3_trims_content(llama):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  padded answer \n"}]
    r = render(llama, msgs, 4096)
    assert supervised_text(llama, r) == ["padded answer<|eot_id|>"]


def test_reply_equal_to_header_words_is_found_after_header(qwen):
    # the fallback search must not mistake the role name in the header for the reply
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "<think>\nx\n</think>\n\nassistant"},
        {"role": "user", "content": "assistant"},
        {"role": "assistant", "content": "ok"},
    ]
    r = render(qwen, msgs, 4096)
    assert supervised_text(qwen, r) == ["assistant<|im_end|>", "<think>\n\n</think>\n\nok<|im_end|>"]


def test_truncation(qwen):
    r_full = render(qwen, MULTI, 4096)
    r = render(qwen, MULTI, 20)
    assert r.truncated and len(r.input_ids) == 20 and len(r.loss_mask) == 20
    assert r.input_ids == r_full.input_ids[:20] and r.loss_mask == r_full.loss_mask[:20]


def test_no_assistant_turn_has_no_supervision(qwen):
    r = render(qwen, [{"role": "user", "content": "hello there"}], 4096)
    assert sum(r.loss_mask) == 0


def test_untraceable_template_raises(qwen):
    import copy

    tok = copy.deepcopy(qwen)
    # earlier assistant turns are upper-cased: no prefix property and no content match
    tok.chat_template = (
        "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + "
        "(m.content | upper if (m.role == 'assistant' and not loop.last) else m.content) + '<|im_end|>\\n' }}"
        "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "lower case reply"},
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "more"},
    ]
    with pytest.raises(DataError, match="row 3: cannot locate assistant turn 1"):
        render(tok, msgs, 4096, where="row 3")


@pytest.mark.parametrize("fmt", ["messages", "sharegpt", "prompt"])
def test_formats_render_identically(tmp_path, qwen, fmt):
    path = make_conversations_jsonl(tmp_path / f"{fmt}.jsonl", 6, fmt=fmt, seed=3)
    ds = load_rows(path)
    assert len(ds) == 6
    ref = make_conversations(6, seed=3, fmt="messages")
    for i, row in enumerate(ds):
        msgs = conversation_of(row, i, path)
        roles = [m["role"] for m in msgs]
        assert roles[-1] == "assistant" and "user" in roles
        if fmt != "prompt":
            assert msgs == ref[i]["messages"]
        r = render(qwen, msgs, 4096)
        assert sum(r.loss_mask) > 0


def test_sharegpt_system_and_unknown_from(tmp_path):
    row = {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "u"}, {"from": "gpt", "value": "a"}]}
    assert [m["role"] for m in conversation_of(row, 0, "x")] == ["system", "user", "assistant"]
    bad = {"conversations": [{"from": "robot", "value": "u"}]}
    with pytest.raises(DataError, match=r"row 7.*robot"):
        conversation_of(bad, 7, "x.jsonl")


def test_unknown_format_names_row_and_fields():
    with pytest.raises(DataError, match=r"row 4: unknown conversation format \(fields found: answer, question\)"):
        conversation_of({"question": "q", "answer": "a"}, 4, "data.jsonl")


def test_malformed_jsonl_names_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    rows = [json.dumps(r) for r in make_conversations(5)]
    rows[3] = rows[3][:-5]  # line 4 is cut short
    p.write_text("\n".join(rows) + "\n")
    with pytest.raises(DataError, match=r"line 4"):
        load_rows(p)


def test_missing_and_empty(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_rows(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="empty"):
        load_rows(tmp_path / "empty.jsonl")


def test_parquet_arrow_and_saved_dataset(tmp_path):
    import datasets

    rows = make_conversations(5, seed=1)
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dd"))
    for path, split, n in [(tmp_path / "d.parquet", "train", 5), (tmp_path / "saved", "train", 5), (tmp_path / "dd", "test", 1)]:
        got = load_rows(path, split=split)
        assert len(got) == n
        assert conversation_of(got[0], 0, path) == rows[0]["messages"]
    with pytest.raises(DataError, match="no split 'val'"):
        load_rows(tmp_path / "dd", split="val")
    assert len(load_rows(tmp_path / "d.parquet", max_samples=2)) == 2


def test_fingerprint_follows_bytes(tmp_path):
    p = make_conversations_jsonl(tmp_path / "a.jsonl", 4)
    f1 = dataset_fingerprint(p)
    assert dataset_fingerprint(p) == f1
    assert dataset_fingerprint(p, max_samples=2) != f1
    make_conversations_jsonl(p, 4, seed=9)
    assert dataset_fingerprint(p) != f1


def test_broken_lines_are_rows_with_no_fields_when_skipped(tmp_path):
    """A directory of two JSON-lines files, the second with a cut line and a bare value: without skipping
    the first stops the load, naming its line; with it each is a row of its own (the rows after it keep
    their numbers, across files), with its RowError, and the files themselves are left as they were."""
    from dflash.chat import read_rows

    rows = make_conversations(5)
    for i, r in enumerate(rows):
        r["id"] = i
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    second = json.dumps(rows[2]) + "\n" + json.dumps(rows[3])[:30] + "\n\n\"text\"\n" + json.dumps(rows[4]) + "\n"
    (tmp_path / "b.jsonl").write_text(second)
    with pytest.raises(DataError, match=r"b.jsonl, line 2: not valid JSON .*Fix or delete that line"):
        read_rows(tmp_path)
    ds, broken = read_rows(tmp_path, skip_bad_lines=True)
    assert [r["id"] for r in ds] == [0, 1, 2, None, None, 4]
    assert {i: e.kind for i, e in broken.items()} == {3: "not valid JSON", 4: "not a JSON object"}
    assert "b.jsonl, line 4 (row 4): a JSON str" in str(broken[4])
    ds, broken = read_rows(tmp_path, max_samples=4, check=False, skip_bad_lines=True)
    assert len(ds) == 4 and list(broken) == [3]
    assert (tmp_path / "b.jsonl").read_text() == second
