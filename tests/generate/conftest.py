"""Fixtures of the generate tests: tiny real checkpoints and small conversation files."""

from __future__ import annotations

import json

import pytest

from helpers import make_conversations_jsonl, make_tiny_target


def _never_stopping(tmp_path_factory, arch: str):
    d = make_tiny_target(tmp_path_factory.mktemp("gen_target"), arch=arch, name=f"long-{arch}")
    cfg = json.loads((d / "config.json").read_text())
    gen = json.loads((d / "generation_config.json").read_text())
    gen["eos_token_id"] = cfg["vocab_size"] - 1
    (d / "generation_config.json").write_text(json.dumps(gen))
    return d


@pytest.fixture(scope="session")
def long_target(tmp_path_factory):
    """A random-init Qwen3 whose generation stops only at --max-new-tokens: its generation_config's eos is a
    spare id the model never picks, so every response is as long as asked (a run long enough to kill)."""
    return _never_stopping(tmp_path_factory, "qwen3")


@pytest.fixture(scope="session")
def long_llama(tmp_path_factory):
    """The same as a Llama: `transformers serve` parses the output of Qwen-family models (model_type qwen*)
    with a response template run on the raw decode, special tokens included, which on a random model's
    text is not the plain decode every server returns for other models; a Llama's reply is that decode."""
    return _never_stopping(tmp_path_factory, "llama")


@pytest.fixture
def chats(tmp_path):
    return make_conversations_jsonl(tmp_path / "chats.jsonl", 12, max_words=8)
