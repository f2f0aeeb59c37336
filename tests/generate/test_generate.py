"""`dflash generate` in-process: the target's own greedy continuation, resumption after kill -9, what
precompute makes of the output, and the refusals (nothing half-written)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dflash.config import GenerateConfig
from dflash.errors import ConfigError, DataError
from dflash.generate.journal import load_records, work_dir
from dflash.generate.local import STATIC_CACHE_ROWS, LocalEngine, Request, static_cache_note, static_width
from dflash.generate.run import run_generate
from helpers import build_store, make_conversations_jsonl, make_tiny_target
from processes import invoke

ROOT = Path(__file__).resolve().parents[2]
EMBEDDED = ROOT / "data" / "target_model"


def cfg(**kw) -> GenerateConfig:
    base = dict(gpus="cpu", max_new_tokens=16, batch_size=4)
    base.update({k: str(v) if isinstance(v, Path) else v for k, v in kw.items()})
    return GenerateConfig(**base)


def greedy_reference(model, tok, messages, max_new: int, eos: int) -> str:
    """The target's own greedy continuation: one full forward per token, argmax, no cache, no batch."""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    new = []
    with torch.no_grad():
        for _ in range(max_new):
            nxt = int(model(torch.tensor([ids + new])).logits[0, -1].argmax())
            if nxt == eos:
                break
            new.append(nxt)
    return tok.decode(new, skip_special_tokens=True)


@pytest.mark.parametrize("static_cache,batch_size", [("off", 3), ("on", 4)])
def test_in_process_greedy_is_the_targets_own_greedy_continuation(tmp_path, static_cache, batch_size):
    # the embedded target writes real, multi-token answers (a random one stops at once); with the static
    # cache every batch is padded to a power-of-two width and to 4 rows (filler rows in every round)
    rows = [json.loads(x) for x in (ROOT / "data" / "heldout.jsonl").read_text().splitlines()[:3]]
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    summary = run_generate(cfg(target=EMBEDDED, data=data, out=out, max_new_tokens=32, turns="all",
                               batch_size=batch_size, static_cache=static_cache))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(EMBEDDED)
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED, dtype=torch.float32).eval()
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(got) == len(rows) and summary["rows"] == len(rows) and summary["failed"] == {}
    checked = 0
    for row in got:
        msgs = row["messages"]
        for i, m in enumerate(msgs):
            if m["role"] == "assistant":  # each turn follows the target's own earlier turns
                assert m["content"] == greedy_reference(model, tok, msgs[:i], 32, tok.eos_token_id)
                checked += 1
    assert checked >= len(rows) and any(len(m["content"]) > 40 for r in got for m in r["messages"])


def test_static_cache_is_reset_and_reused_across_the_batches_of_one_width(tmp_path):
    # a new cache per batch would give the decode step's CUDA graphs new addresses to record again
    reqs = [Request(i, [{"role": "user", "content": text}]) for i, text in
            enumerate(["Hi.", "What is two plus two?", "Name a colour.", "Say yes.", " ".join(["word"] * 80)])]
    eng = LocalEngine(cfg(target=EMBEDDED, max_new_tokens=12, batch_size=2, static_cache="on"), "cpu")
    seen = []

    def on_batch(responses):
        seen.append((len(responses), eng._cache_shape, eng._cache.layers[0].keys))  # held: no address reuse

    got = eng.generate(reqs, on_batch=on_batch)
    want = LocalEngine(cfg(target=EMBEDDED, max_new_tokens=12, batch_size=2, static_cache="off"), "cpu").generate(reqs)
    assert [r.text for r in got] == [r.text for r in want] and any(r.tokens > 1 for r in got)
    (_, shape1, keys1), (_, shape2, keys2), (_, shape3, keys3) = seen
    assert shape1 == shape2 and keys1 is keys2  # the second batch of the width decoded in the same tensors
    assert shape3[1] > shape1[1] and keys3 is not keys1  # the long prompt's wider batch has a cache of its own


def test_the_decode_step_compiles_once_for_the_batches_of_a_width():
    # the engine's own cache still gets transformers' compiled decode step, once for a width (whether the
    # CUDA graphs then replay is a GPU matter: the cache-reuse test checks the tensors stay the same).
    # transformers compiles only on accelerators unless told to compile on every device; Dynamo's eager
    # backend counts the compilations without paying for Inductor on the CPU
    from torch._dynamo.utils import counters
    from transformers.generation import CompileConfig

    reqs = [Request(i, [{"role": "user", "content": t}]) for i, t in enumerate(["Hi.", "Two plus two?", "Yes?", "Red."])]
    eng = LocalEngine(cfg(target=EMBEDDED, max_new_tokens=8, batch_size=2, static_cache="on", temperature=0.8), "cpu")
    every_device = CompileConfig(backend="eager", mode=None)
    every_device._compile_all_devices = True
    eng.model.generation_config.compile_config = every_device
    before = counters["frames"]["ok"]
    eng.generate(reqs)
    assert eng._cache_shape[1] < 128 and counters["frames"]["ok"] - before == 1  # two batches, one graph


@pytest.mark.parametrize("static_cache", ["off", "on"])
def test_batch_tokens_give_long_prompts_fewer_rows_and_the_same_replies(static_cache):
    # on a real target a 128-row static batch of 7,936-token prompts asked for a 15.5 GiB attention mask
    # and ran out of memory: the budget caps rows x (width + new tokens)
    texts = ["Hi.", "Yes?", "Red.", "Two?"] + [" ".join(["word"] * n) for n in (40, 45, 120, 130, 135)]
    reqs = [Request(i, [{"role": "user", "content": t}]) for i, t in enumerate(texts)]
    opts = dict(target=EMBEDDED, max_new_tokens=8, batch_size=4, static_cache=static_cache)
    eng = LocalEngine(cfg(**opts, batch_tokens=300), "cpu")
    batches, shapes = [], []

    def on_batch(responses):
        batches.append(sorted(r.key for r in responses))
        shapes.append(eng._cache_shape)

    got = eng.generate(reqs, on_batch=on_batch)
    for keys in batches:
        width = eng.width_for(max(eng.prompt_length(reqs[k].messages) for k in keys))
        assert len(keys) == 1 or len(keys) * (width + eng.new_tokens_for(width)) <= 300
    assert batches[0] == [0, 1, 2, 3] and [len(b) for b in batches[-3:]] == [1, 1, 1]  # wide ones alone
    assert sorted(k for b in batches for k in b) == list(range(len(reqs)))
    if static_cache == "on":  # filled to the width's own row count, not to --batch-size
        assert all(rows == eng.rows_for(length - 8) for rows, length in shapes)  # 8 new tokens a row
        assert shapes[0][0] == 4 and shapes[-1][0] == 1
    want = LocalEngine(cfg(**opts), "cpu").generate(reqs)  # the default budget: one batch a width
    assert [r.text for r in got] == [r.text for r in want] and any(r.tokens > 1 for r in got)


def test_static_width_is_a_power_of_two_that_leaves_room_for_the_reply():
    assert [static_width(w, 512, 8192) for w in (1, 64, 65, 300, 1024, 1025)] == [64, 64, 128, 512, 1024, 2048]
    # near the context the width stops where --max-new-tokens still fits, and never cuts the prompt
    assert static_width(5000, 2048, 8192) == 6144 and static_width(7000, 2048, 8192) == 7000
    assert static_width(3000, 512, 0) == 4096  # a target that declares no context


def test_many_rows_on_a_gpu_without_the_static_cache_get_a_hint():
    note = static_cache_note("off", ["cuda:0"], STATIC_CACHE_ROWS)
    assert note and "--static-cache on" in note and f"{STATIC_CACHE_ROWS:,} rows" in note
    assert static_cache_note("off", ["cuda:0"], STATIC_CACHE_ROWS - 1) is None  # finishes before compiling would
    assert static_cache_note("off", ["cpu"], 10 ** 6) is None and static_cache_note("on", ["cuda:0"], 10 ** 6) is None


def test_all_formats_come_back_in_their_format_and_precompute_reads_them(tmp_path, tiny_target):
    for fmt in ("messages", "sharegpt", "prompt"):
        data = make_conversations_jsonl(tmp_path / f"{fmt}.jsonl", 5, fmt=fmt, max_words=6)
        out = tmp_path / f"gen-{fmt}.jsonl"
        run_generate(cfg(target=tiny_target, data=data, out=out, turns="last"))
        before = [json.loads(x) for x in data.read_text().splitlines()]
        after = [json.loads(x) for x in out.read_text().splitlines()]
        assert [set(r) for r in after] == [set(r) for r in before]
    store = build_store(tmp_path / "store", tiny_target, tmp_path / "gen-messages.jsonl", writer="thread")
    from dflash.store import open_store

    assert len(open_store(store)) == 5


def test_thinking_switch_reaches_the_template_and_is_refused_where_there_is_none(tmp_path, tiny_target, chats):
    eng = LocalEngine(cfg(target=tiny_target, thinking="off"), "cpu")
    msgs = [{"role": "user", "content": "hi"}]
    assert eng.tokenizer.decode(eng.encode(msgs)).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    eng.cfg = cfg(target=tiny_target, thinking="on")
    assert eng.tokenizer.decode(eng.encode(msgs)).endswith("<|im_start|>assistant\n")
    think = eng.tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    text_ids = eng.tokenizer("because", add_special_tokens=False)["input_ids"]
    assert eng.decode([think[0], *text_ids, think[1]]) == "<think>because</think>"  # kept, though special
    llama = make_tiny_target(tmp_path, arch="llama")
    with pytest.raises(ConfigError, match="no `enable_thinking` switch"):
        run_generate(cfg(target=llama, data=chats, out=tmp_path / "o.jsonl", thinking="on"))
    assert not (tmp_path / "o.jsonl").exists() and not work_dir(tmp_path / "o.jsonl").exists()


def test_bad_inputs_leave_nothing_behind(tmp_path, tiny_target, chats):
    out = tmp_path / "out.jsonl"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "a"}]}\n{"text": "no conversation"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl, row 1: unknown conversation format"):
        run_generate(cfg(target=tiny_target, data=bad, out=out))
    with pytest.raises(ConfigError, match="needs --target DIR"):
        run_generate(cfg(data=chats, out=out))
    with pytest.raises(ConfigError, match="is the dataset itself"):
        run_generate(cfg(target=tiny_target, data=chats, out=chats))
    assert not out.exists() and not work_dir(out).exists()
    out.write_text("someone's file\n")
    with pytest.raises(ConfigError, match="not written by `dflash generate`"):
        run_generate(cfg(target=tiny_target, data=chats, out=out))
    assert out.read_text() == "someone's file\n"


def test_a_rerun_resumes_and_other_inputs_are_refused(tmp_path, tiny_target, chats, capsys):
    out = tmp_path / "out.jsonl"
    run_generate(cfg(target=tiny_target, data=chats, out=out))
    first = out.read_bytes()
    assert run_generate(cfg(target=tiny_target, data=chats, out=out))["generated_now"] == 0
    assert "already complete" in capsys.readouterr().out and out.read_bytes() == first
    with pytest.raises(ConfigError, match="other inputs \\(changed: max_new_tokens"):
        run_generate(cfg(target=tiny_target, data=chats, out=out, max_new_tokens=5))
    assert out.read_bytes() == first
    run_generate(cfg(target=tiny_target, data=chats, out=out, max_new_tokens=5, restart_changed=True))
    records = load_records(work_dir(out))  # started over: a journal of the new inputs only
    assert len(records) == 12 and all(r["tokens"] <= 5 * 2 for r in records.values())


def _cli(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dflash.cli", "generate", *map(str, args)], cwd=args[1].parent,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"})


@pytest.mark.slow
def test_kill_9_then_the_same_command_gives_the_uninterrupted_file(tmp_path, long_target):
    data = make_conversations_jsonl(tmp_path / "chats.jsonl", 12, max_words=6)
    ref = tmp_path / "ref.jsonl"
    opts = dict(max_new_tokens=12, batch_size=1, turns="all")  # windows of 4 rows
    run_generate(cfg(target=long_target, data=data, out=ref, **opts))
    out = tmp_path / "out.jsonl"
    args = ["--target", long_target, "--data", data, "--out", out, "--gpus", "cpu", "--max-new-tokens", 12,
            "--batch-size", 1, "--turns", "all"]
    journal = work_dir(out) / "shard-00000.journal"
    for kill_after in (1, 5):  # rows journaled before the kill: in the first window, then in a later one
        p = _cli(*args)
        deadline = time.time() + 120
        while time.time() < deadline and p.poll() is None:
            if journal.exists() and journal.read_bytes().count(b"\n") >= kill_after:
                break
            time.sleep(0.002)
        assert p.poll() is None, "the run ended before it could be killed: " + p.communicate()[1][-2000:]
        p.send_signal(signal.SIGKILL)
        p.wait()
        assert not out.exists()
    # a kill inside an atomic write leaves its temporary file; the resuming run (holding the lock) removes
    # it, and only this output's: another output's beside it is not its to touch
    strays = [tmp_path / f".{out.name}.tmp-99999", work_dir(out) / ".meta.json.tmp-99999"]
    other = tmp_path / ".other.jsonl.tmp-99999"
    for p in (*strays, other):
        p.write_bytes(b"half")
    rc, stdout, stderr = invoke(args, command="generate", cwd=tmp_path)  # the resuming run in process
    assert rc == 0, stderr
    assert "resuming" in stdout
    assert out.read_bytes() == ref.read_bytes()
    assert not any(p.exists() for p in strays) and other.exists()
    rows = [json.loads(x)["row"] for x in journal.read_text().splitlines()]
    assert sorted(rows) == list(range(12))  # no row lost, none generated twice


def test_turns_none_writes_the_rows_back_byte_for_byte_without_a_model(tmp_path, chats):
    out = tmp_path / "out.jsonl"
    s = run_generate(cfg(data=chats, out=out, turns="none"))  # the pipeline's off switch: no target needed
    assert out.read_bytes() == chats.read_bytes() and s["rows"] == 12 and s["tokens"] == 0


def test_in_process_rows_reach_the_journal_a_batch_at_a_time(tmp_path, long_target):
    """A stopped or killed run keeps every finished batch: a run once stopped mid-window (a window is 4
    batches) lost 1,536 rows of finished batches with it."""
    from dflash.chat import load_rows
    from dflash.generate.drive import drive
    from dflash.generate.journal import Journal
    from dflash.generate.rows import plan_row

    data = make_conversations_jsonl(tmp_path / "chats.jsonl", 10, max_words=6)
    c = cfg(target=long_target, data=data, max_new_tokens=6, batch_size=2, turns="last")  # windows of 8 rows
    rows = [dict(r) for r in load_rows(data)]
    todo = [plan_row(r, i, data, "last") for i, r in enumerate(rows)]
    work = tmp_path / "work"
    work.mkdir()
    journal = Journal(work, 0)
    seen = []  # (rows reported, lines in the journal at that moment)

    def report(n, tokens):
        seen.append((n, journal.path.read_bytes().count(b"\n")))

    try:
        drive(LocalEngine(c, "cpu"), c, rows, todo, journal, report)
    finally:
        journal.close()
    assert [n for n, _ in seen] == [2, 2, 2, 2, 2]  # a report per batch of 2, not one per window of 8
    assert [lines for _, lines in seen] == [2, 4, 6, 8, 10]  # each batch in the journal when reported
    recs = load_records(work)
    assert sorted(recs) == list(range(10)) and all(r["out"] is not None and r["tokens"] == 6 for r in recs.values())


def test_samples_write_every_row_n_times_sampled_apart_and_resume_by_copy(tmp_path, long_target, capsys):
    # a random target that never stops: its sampled replies differ unless the twins share their draws (the
    # embedded target is too sure of itself to tell)
    src = [json.loads(x) for x in (ROOT / "data" / "heldout.jsonl").read_text().splitlines()[:3]]
    rows = [{"id": f"c{i}", "messages": r["messages"][:2]} for i, r in enumerate(src[:2])]
    rows.append({"messages": src[2]["messages"][:2]})  # no id: copies stay as they are
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    opts = dict(target=long_target, data=data, out=out, samples=2, temperature=1.0, max_new_tokens=8, turns="last")
    summary = run_generate(cfg(**opts))
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert summary["rows"] == 6 and summary["num_rows"] == 6
    assert [r.get("id") for r in got] == ["c0.s0", "c1.s0", None, "c0.s1", "c1.s1", None]  # sample-major
    for k, r in enumerate(got):
        assert r["messages"][0] == rows[k % 3]["messages"][0] and r["messages"][1]["role"] == "assistant"
    replies = [r["messages"][1]["content"] for r in got]
    assert summary["tokens"] == 6 * 8 and all(replies[i] != replies[i + 3] for i in range(3))  # twins apart
    assert run_generate(cfg(**opts))["generated_now"] == 0 and "already complete" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="other inputs \\(changed: num_rows, samples"):
        run_generate(cfg(**{**opts, "samples": 3}))
    assert [json.loads(x) for x in out.read_text().splitlines()] == got


def test_samples_are_refused_where_they_would_be_copies(tmp_path, chats):
    out = tmp_path / "out.jsonl"
    with pytest.raises(ConfigError, match="--samples > 1 needs --temperature > 0"):
        run_generate(cfg(target=EMBEDDED, data=chats, out=out, samples=2))
    with pytest.raises(ConfigError, match="--samples must be at least 1"):
        run_generate(cfg(target=EMBEDDED, data=chats, out=out, samples=0, temperature=0.8))
    assert not out.exists() and not work_dir(out).exists()


def test_skip_bad_rows_leaves_out_broken_lines_and_rows_with_nothing_to_answer(tmp_path):
    """A line cut by a crashed writer and a row with no user turn: without --skip-bad-rows the first stops
    the run, naming its line, before anything is written; with it both are left out, listed with file,
    line and kind in the journal directory and counted, and the good rows come out in their order."""
    good = [{"id": i, "messages": [{"role": "user", "content": f"Say {w}."}]} for i, w in enumerate("abc")]
    lines = [json.dumps(good[0]), json.dumps(good[1])[:25], json.dumps(good[1]),
             json.dumps({"id": 9, "messages": [{"role": "assistant", "content": "hi"}]}), json.dumps(good[2])]
    data = tmp_path / "in.jsonl"
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    with pytest.raises(DataError, match="line 2: not valid JSON .*Fix or delete that line"):
        run_generate(cfg(target=EMBEDDED, data=data, out=out, max_new_tokens=2, turns="all"))
    assert not out.exists() and not work_dir(out).exists()
    summary = run_generate(cfg(target=EMBEDDED, data=data, out=out, max_new_tokens=2, turns="all", skip_bad_rows=True))
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in got] == [0, 1, 2] and summary["rows"] == 3 and summary["skipped"] == 2
    report = [json.loads(x) for x in (work_dir(out) / "skipped_rows.jsonl").read_text().splitlines()]
    assert [(r["row"], r["line"], r["kind"], r["file"]) for r in report] == \
        [(1, 2, "not valid JSON", str(data)), (3, 4, "nothing to answer", str(data))]
    again = run_generate(cfg(target=EMBEDDED, data=data, out=out, max_new_tokens=2, turns="all", skip_bad_rows=True))
    assert again["skipped"] == 2 and again["generated_now"] == 0


def test_a_full_disk_while_writing_the_output_is_named_for_generate(tmp_path, monkeypatch):
    """The output goes through the stages' shared atomic write; its full-disk error must still tell a
    generate user what to do (not precompute's advice), and leave no temporary file."""
    import errno

    from dflash.errors import GenerateError
    from dflash.generate.journal import atomic_write

    real = os.fsync

    def fsync(fd):  # where delayed allocation reports ENOSPC: the fsync of the temporary file
        if ".tmp-" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    out = tmp_path / "replies.jsonl"
    with pytest.raises(GenerateError) as e:
        atomic_write(out, b'{"messages": []}\n')
    msg = str(e.value)
    assert f"cannot write {out}" in msg and "rerun the same command" in msg and "precompute" not in msg
    assert list(tmp_path.iterdir()) == []


def test_max_prompt_tokens_leaves_out_the_longer_prompts_and_keeps_the_others_replies(tmp_path, tiny_target, capsys):
    from dflash.chat import read_rows
    from dflash.generate.rows import plan_row, prompt_messages

    data = make_conversations_jsonl(tmp_path / "chats.jsonl", 12, min_words=2, max_words=40)
    engine = LocalEngine(cfg(target=tiny_target, data=data, out=tmp_path / "x.jsonl"), "cpu")
    rows = [dict(r) for r in read_rows(str(data), "train", None)[0]]
    lengths = []
    for i, r in enumerate(rows):
        p = plan_row(r, i, str(data), "last")
        lengths.append(engine.prompt_length(prompt_messages(p.messages, p.turns[0])))
    cap = sorted(lengths)[len(lengths) // 2]
    over = [i for i, n in enumerate(lengths) if n > cap]
    assert 0 < len(over) < len(rows)

    full, capped = tmp_path / "full.jsonl", tmp_path / "capped.jsonl"
    run_generate(cfg(target=tiny_target, data=data, out=full, turns="last"))
    s = run_generate(cfg(target=tiny_target, data=data, out=capped, turns="last", max_prompt_tokens=cap))
    assert s["over_max_prompt"] == len(over) and s["failed"] == {} and s["rows"] == len(rows) - len(over)
    assert f"left out {len(over)} rows whose prompt is over --max-prompt-tokens" in capsys.readouterr().out
    kept = [line for i, line in enumerate(full.read_text().splitlines()) if i not in over]
    assert capped.read_text().splitlines() == kept  # the same replies, the longer prompts' rows left out
    with pytest.raises(ConfigError, match="changed: max_prompt_tokens"):
        run_generate(cfg(target=tiny_target, data=data, out=capped, turns="last", max_prompt_tokens=cap + 1))
    with pytest.raises(ConfigError, match="--max-prompt-tokens counts the target's tokens in process"):
        run_generate(cfg(endpoint="http://127.0.0.1:9", data=data, out=tmp_path / "e.jsonl", max_prompt_tokens=cap))
