"""Continuous batching in `dflash generate` (dflash/generate/refill.py): rows refilled as they finish, one
ring-shaped cache a prompt width, the live rows halved into the lower rows at a width's end, per-row
draws; on CPU the decode step runs without graphs and gives the batch path's tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash.config import GenerateConfig
from dflash.errors import ConfigError
from dflash.generate import refill
from dflash.generate.journal import work_dir
from dflash.generate.local import LocalEngine, Request
from dflash.generate.run import run_generate
from target_families import FAMILIES, make_family_target

ROOT = Path(__file__).resolve().parents[2]
EMBEDDED = ROOT / "data" / "target_model"
SHORT = ["Hi.", "What is two plus two?", "Name a colour.", "Say yes.", "Who are you?", "Count to three.",
         "Red or blue?"]


def cfg(**kw) -> GenerateConfig:
    base = dict(target=str(EMBEDDED), gpus="cpu", max_new_tokens=20, batch_size=4)
    base.update({k: str(v) if isinstance(v, Path) else v for k, v in kw.items()})
    return GenerateConfig(**base)


def requests(texts) -> list[Request]:
    return [Request(i, [{"role": "user", "content": t}]) for i, t in enumerate(texts)]


class Spy:
    """Records each ring built and the row count of every decode step."""

    def __init__(self, monkeypatch):
        self.rings, self.steps, self.admitted = [], [], []
        ring_init, step, admit = refill.Ring.__init__, refill.Ring.step, refill.Ring.admit

        def init(ring, engine, rows, width, length):
            ring_init(ring, engine, rows, width, length)
            self.rings.append((rows, width, length))

        def counted(ring, b):
            self.steps.append((len(self.rings) - 1, b))
            return step(ring, b)

        def admitting(ring, slots, items):
            self.admitted.append(len(items))
            return admit(ring, slots, items)

        monkeypatch.setattr(refill.Ring, "__init__", init)
        monkeypatch.setattr(refill.Ring, "step", counted)
        monkeypatch.setattr(refill.Ring, "admit", admitting)


def test_rows_refilled_as_they_finish_give_the_one_batch_greedy_tokens(monkeypatch):
    spy = Spy(monkeypatch)
    reqs = requests(SHORT)
    eng = LocalEngine(cfg(batch_size=2, max_new_tokens=40, continuous_batching="on"), "cpu")
    got = eng.generate(reqs)
    # the reference: every row in one batch of the batch path, no cache tricks
    want = LocalEngine(cfg(batch_size=len(reqs), max_new_tokens=40, continuous_batching="off"), "cpu").generate(reqs)
    assert [r.text for r in got] == [r.text for r in want]
    assert [r.tokens for r in got] == [r.tokens for r in want] and [r.cut for r in got] == [r.cut for r in want]
    assert len({r.tokens for r in got}) > 2 and any(not r.cut for r in got)  # rows ended at different lengths
    assert spy.rings == [(2, 64, 104)]  # one width: 2 rows, prompt width 64 + 40 new tokens
    assert sum(spy.admitted) == len(reqs) and len(spy.admitted) >= 4  # freed rows refilled as they finish


def test_a_width_ends_on_half_the_rows_and_widths_get_rings_of_their_own(monkeypatch):
    spy = Spy(monkeypatch)
    texts = SHORT[:5] + [" ".join(["word"] * 90), " ".join(["word"] * 80)]  # 99 and 89 tokens
    reqs = requests(texts)
    eng = LocalEngine(cfg(batch_size=4, max_new_tokens=16, continuous_batching="on"), "cpu")
    got = eng.generate(reqs)
    want = LocalEngine(cfg(batch_size=len(reqs), max_new_tokens=16, continuous_batching="off"), "cpu").generate(reqs)
    assert [r.text for r in got] == [r.text for r in want] and [r.tokens for r in got] == [r.tokens for r in want]
    assert [(w, n) for _, w, n in spy.rings] == [(64, 80), (128, 144)]  # short prompts first, in a narrow ring
    assert spy.rings[1][0] == 2  # a ring holds no more rows than its width has prompts
    narrow = [b for ring, b in spy.steps if ring == 0]
    assert narrow[0] == 4 and min(narrow) < 4  # the narrow width's last rows ran on fewer rows


def test_a_decode_step_reads_each_key_value_head_once(monkeypatch, long_target):
    """The ring's keys are the decode's whole cost on long prompts: a grouped-query target's decode step must
    attend on its key/value heads as stored, not on a copy per query head (transformers' `repeat_kv`)."""
    from transformers.integrations import sdpa_attention

    eng = LocalEngine(cfg(target=long_target, max_new_tokens=8, continuous_batching="on"), "cpu")
    model_cfg = eng.model.config
    assert model_cfg.num_key_value_heads < model_cfg.num_attention_heads
    copies, repeat = [], sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda x, n: copies.append(tuple(x.shape)) or repeat(x, n))
    ring = refill.Ring(eng, 4, 64, 72)
    items = [refill.Item(k, eng.encode(r.messages), 8, refill.mix64(0, k, 1)) for k, r in enumerate(requests(SHORT[:4]))]
    ring.admit([0, 1, 2, 3], items)
    assert copies  # the prefill (many query tokens) does copy: the spy sees the attention it is meant to see
    copies.clear()
    for _ in range(3):
        ring.step(4)
    assert copies == []


def test_sampled_replies_depend_on_the_row_and_seed_alone(long_target):
    texts = ["one two", "three four five", "six", "seven eight"] * 2  # twins: the same prompt, another row
    reqs = requests(texts)
    opts = dict(target=long_target, max_new_tokens=8, temperature=0.8, continuous_batching="on")
    a = LocalEngine(cfg(**opts, batch_size=3), "cpu").generate(reqs, seed=5)
    eng = LocalEngine(cfg(**opts, batch_size=8), "cpu")
    b = eng.generate(list(reversed(reqs)), seed=5)
    assert [r.text for r in a] == [r.text for r in reversed(b)]  # other batches, other order: the same draws
    assert all(a[i].text != a[i + 4].text for i in range(4))  # twins drawn apart
    c = eng.generate(reqs, seed=6)
    assert sum(x.text != y.text for x, y in zip(a, c)) >= 6
    greedy = LocalEngine(cfg(**{**opts, "temperature": 0.0}, batch_size=8), "cpu").generate(reqs)
    assert [r.text for r in a] != [r.text for r in greedy]


def test_draws_follow_the_distribution_and_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    salt = torch.tensor([refill.mix64(0, k, 3) for k in range(4000)])
    count = torch.zeros(4000, dtype=torch.long)
    freq = torch.bincount(refill.pick(logits, salt, count, 1.0, 1.0), minlength=4).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03)
    nucleus = refill.pick(logits, salt, count, 1.0, 0.7)
    assert set(nucleus.tolist()) == {0, 1}  # 0.5 + 0.3 reach 0.7: the rest are never drawn
    assert refill.pick(logits, salt, count, 0.0, 1.0).eq(0).all()  # temperature 0: argmax
    assert not torch.equal(refill.pick(logits, salt, count + 1, 1.0, 1.0), refill.pick(logits, salt, count, 1.0, 1.0))


def test_on_cpu_the_step_runs_without_graphs_and_layouts_it_cannot_model_are_refused(tmp_path):
    eng = LocalEngine(cfg(continuous_batching="on"), "cpu")
    ring = refill.Ring(eng, 4, 64, 80)
    assert ring.graphs == {} and ring.sizes == [4, 2, 1]
    assert ring.step(4) == ring.next.tolist()  # eager, all rows
    assert not LocalEngine(cfg(), "cpu").continuous  # auto: the batch path on CPU
    eng.model.config.layer_types = ["sliding_attention"] + eng.model.config.layer_types[1:]
    assert "sliding_attention" in refill.supports_ring(eng.model)
    with pytest.raises(ConfigError, match="--continuous-batching off"):
        eng._continuous("on")
    assert eng._continuous("auto") is False


def test_a_resumed_sampled_run_writes_the_uninterrupted_file(tmp_path, long_target):
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"row {i} " + "word " * (i % 4)}]})
                            + "\n" for i in range(9)))
    opts = dict(target=long_target, data=data, turns="last", samples=2, temperature=0.8, max_new_tokens=6,
                batch_size=3, continuous_batching="on")
    ref = tmp_path / "ref.jsonl"
    run_generate(cfg(**opts, out=ref))
    out = tmp_path / "out.jsonl"
    run_generate(cfg(**opts, out=out))
    journal = next(work_dir(out).glob("shard-*.journal"))
    lines = journal.read_text().splitlines(keepends=True)
    journal.write_text("".join(lines[:7]))  # as if killed after 7 rows
    out.unlink()
    summary = run_generate(cfg(**{**opts, "batch_size": 5}, out=out))  # even with other batches
    assert summary["generated_now"] == 18 - 7
    assert out.read_bytes() == ref.read_bytes()


def test_every_turn_regenerated_in_turn_gives_the_batch_paths_file_and_rows_reach_the_journal_as_they_finish(
        tmp_path):
    from dflash.generate.drive import drive
    from dflash.generate.journal import Journal
    from dflash.generate.rows import plan_row
    from helpers import make_conversations_jsonl

    data = make_conversations_jsonl(tmp_path / "chats.jsonl", 6, max_words=6)
    outs = {}
    for mode in ("off", "on"):
        outs[mode] = tmp_path / f"{mode}.jsonl"
        run_generate(cfg(data=data, out=outs[mode], turns="all", max_new_tokens=12, batch_size=2,
                         continuous_batching=mode))
    assert outs["on"].read_bytes() == outs["off"].read_bytes()
    c = cfg(data=data, turns="last", max_new_tokens=12, batch_size=2, continuous_batching="on")
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    (tmp_path / "work").mkdir()
    journal, seen = Journal(tmp_path / "work", 0), []
    try:
        drive(LocalEngine(c, "cpu"), c, rows, [plan_row(r, i, data, "last") for i, r in enumerate(rows)], journal,
              lambda n, tokens: seen.append((n, journal.path.read_bytes().count(b"\n"))))
    finally:
        journal.close()
    assert sum(n for n, _ in seen) == 6 and len(seen) >= 3  # a journal write as rows finish, not one a window
    assert [lines for _, lines in seen] == [sum(n for n, _ in seen[:i + 1]) for i in range(len(seen))]


RING_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")  # every layer attends over the whole context


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_decodes_through_the_ring_or_says_why_not(tmp_path, family, capsys):
    """`auto` on a GPU takes the ring exactly where it models the target: there, the ring's greedy tokens are
    the batch path's; elsewhere (sliding windows, linear attention) `on` is refused with the reason."""
    target = make_family_target(tmp_path, family, num_layers=4)
    batch = LocalEngine(cfg(target=target, max_new_tokens=12, continuous_batching="off"), "cpu")
    why = refill.supports_ring(batch.model)
    if family not in RING_FAMILIES:
        assert why and ("sliding_attention" in why or "linear_attention" in why), why
        with pytest.raises(ConfigError, match="--continuous-batching off"):
            LocalEngine(cfg(target=target, continuous_batching="on"), "cpu")
        batch.device = torch.device("cuda", 0)  # `auto` decides by the device's type alone; nothing runs there
        assert batch._continuous("auto") is False
        assert f"continuous batching off for this target ({why})" in capsys.readouterr().out
        return
    assert why is None
    reqs = requests(SHORT[:5])
    got = LocalEngine(cfg(target=target, max_new_tokens=12, batch_size=2, continuous_batching="on"), "cpu").generate(reqs)
    want = batch.generate(reqs)
    assert [(r.tokens, r.text) for r in got] == [(r.tokens, r.text) for r in want]
    assert sum(r.tokens for r in got) > len(reqs)  # random weights still decode more than one token a row
