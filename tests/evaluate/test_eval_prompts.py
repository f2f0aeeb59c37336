"""Online eval prompts that outgrow the target's context: a real held-out ShareGPT conversation (27,499
tokens before its last reply) against SmolLM2's 8,192 positions took 25 GiB of attention in fp32 and ran
the eval out of GPU memory.  Such a prompt is left out, named, counted, and the next row taken."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import make_tiny_target, random_run


def _chats(path, lengths: list[int]) -> str:
    """One two-turn conversation per entry, its user turn `n` words long."""
    with open(path, "w", encoding="utf-8") as f:
        for i, n in enumerate(lengths):
            msgs = [{"role": "user", "content": " ".join(["hello"] * n) + f" {i}"},
                    {"role": "assistant", "content": "ok"}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("prompts"))


def test_a_prompt_longer_than_the_budget_is_left_out_and_the_next_taken(target, tmp_path, capsys):
    from dflash.evaluate.run import load_prompts
    from dflash.target_model.capture import load_tokenizer

    tok = load_tokenizer(target)
    chats = _chats(tmp_path / "c.jsonl", [5, 400, 6, 7, 8])
    every = load_prompts(chats, tok)
    assert len(every) == 5
    budget = len(every[1]) - 1  # only row 1 is longer
    assert all(len(p) <= budget for i, p in enumerate(every) if i != 1)

    left_out: list = []
    got = load_prompts(chats, tok, max_samples=3, max_tokens=budget, left_out=left_out)
    assert got == [every[0], every[2], every[3]]  # row 1 left out, row 3 taken to keep three prompts
    assert left_out == [(1, len(every[1]))]
    err = capsys.readouterr().err
    assert f"row 1 of {chats}" in err and f"{len(every[1]):,} tokens" in err

    # without a budget, max_samples still reads the first rows as before
    assert load_prompts(chats, tok, max_samples=3) == every[:3]


def test_no_prompt_fits_is_a_data_error_naming_the_budget(target, tmp_path):
    from dflash.errors import DataError
    from dflash.evaluate.run import load_prompts
    from dflash.target_model.capture import load_tokenizer

    chats = _chats(tmp_path / "c.jsonl", [50, 60])
    with pytest.raises(DataError, match="fits in 10 tokens"):
        load_prompts(chats, load_tokenizer(target), max_tokens=10)


def test_prompt_budget_is_the_context_less_the_new_tokens(target):
    from dflash.errors import ConfigError
    from dflash.evaluate.run import prompt_budget
    from dflash.target_model.files import context_length

    assert context_length(target) == 4096  # make_tiny_target's max_position_embeddings
    assert prompt_budget(str(target), 128) == 4096 - 128
    with pytest.raises(ConfigError, match="does not fit the context"):
        prompt_budget(str(target), 4096)


def test_dflash_eval_leaves_out_a_prompt_beyond_the_context_and_counts_it(target, tmp_path):
    """Through run_eval: the 4,096-position target, one prompt of ~4,100 tokens among short ones."""
    from dflash.config import EvalConfig
    from dflash.evaluate.run import run_eval

    torch.set_num_threads(1)
    run = random_run(target, tmp_path)
    chats = _chats(tmp_path / "c.jsonl", [4, 4100, 5])
    result = run_eval(EvalConfig(run=str(run), prompts=chats, max_new_tokens=8, max_samples=2,
                                 out=str(tmp_path / "eval.json"), plots=False))
    assert result["online"]["num_prompts"] == 2 and result["online"]["prompts_left_out"] == 1
    assert [x["row"] for x in result["online"]["per_prompt"]] == [0, 2]  # row 1 left out, named by row
    assert result["lossless"] is True
