"""The embedded default (data/): conversations made by stages/make_dataset.py and the trained target.

These checks fail if the committed target is random-init, if the splits overlap, or if the dataset
script no longer reproduces the committed files byte for byte.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data"
TARGET = DATA / "target_model"

# Measured on the committed weights: ~0.01 nats per held-out assistant token (data/target_model/TRAINING.json).
# A random-init model of this vocabulary scores ~7.6, one trained for a tenth of the steps ~0.6.
MAX_HELDOUT_LOSS = 0.1


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def target():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TARGET)
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    return tok, model


def test_dataset_is_deterministic(tmp_path):
    train, held = read_jsonl(DATA / "train.jsonl"), read_jsonl(DATA / "heldout.jsonl")
    subprocess.run(
        [sys.executable, str(ROOT / "stages" / "make_dataset.py"), "--out", str(tmp_path),
         "--train", str(len(train)), "--heldout", str(len(held))],
        check=True, capture_output=True,
    )
    for name in ("train.jsonl", "heldout.jsonl"):
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), f"{name} differs from a regeneration"


def test_splits_are_messages_and_disjoint():
    train, held = read_jsonl(DATA / "train.jsonl"), read_jsonl(DATA / "heldout.jsonl")
    assert len(train) >= 1000 and len(held) >= 50
    for row in train + held:
        roles = [m["role"] for m in row["messages"]]
        assert set(roles) <= {"system", "user", "assistant"}
        body = roles[1:] if roles[0] == "system" else roles
        assert body[0::2] == ["user"] * len(body[0::2]) and body[1::2] == ["assistant"] * len(body[0::2])
    assert any(r["messages"][0]["role"] == "system" for r in train)
    assert any(len(r["messages"]) > 3 for r in train)
    train_prompts = {m["content"] for r in train for m in r["messages"] if m["role"] == "user"}
    held_prompts = {m["content"] for r in held for m in r["messages"] if m["role"] == "user"}
    assert not train_prompts & held_prompts
    size = sum((DATA / n).stat().st_size for n in ("train.jsonl", "heldout.jsonl"))
    assert size < 2_000_000


def test_target_files_and_chat_template(target):
    tok, model = target
    cfg = json.loads((TARGET / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    assert (TARGET / "model.safetensors").stat().st_size < 21_000_000
    assert not list(TARGET.glob("*.bin")) and not list(TARGET.glob("*.pt"))
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert len(tok) <= model.config.vocab_size
    # spare ids a drafter can take for its mask token
    mask_id = tok.convert_tokens_to_ids("<|mask|>")
    assert mask_id is not None and mask_id != tok.unk_token_id and mask_id < model.config.vocab_size
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    full = msgs + [{"role": "assistant", "content": "ok"}]
    out = tok.apply_chat_template(full, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    masked = [t for t, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tok.decode(masked) == "ok<|im_end|>"


def test_heldout_loss_is_low(target):
    """Mean next-token loss on held-out assistant tokens: only a trained target gets near zero."""
    tok, model = target
    held = read_jsonl(DATA / "heldout.jsonl")[:40]
    total, count = 0.0, 0
    with torch.no_grad():
        for row in held:
            out = tok.apply_chat_template(row["messages"], tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
            ids = torch.tensor([out["input_ids"]])
            mask = torch.tensor(out["assistant_masks"][1:], dtype=torch.bool)
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            nll = -logp.gather(-1, ids[0, 1:, None])[:, 0]
            total, count = total + float(nll[mask].sum()), count + int(mask.sum())
    loss = total / count
    assert loss < MAX_HELDOUT_LOSS, f"held-out loss {loss:.3f}: the committed target looks untrained"


def _greedy(tok, model, messages, max_new_tokens):
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return gen[0, ids["input_ids"].shape[1]:]


def test_greedy_answer_is_sensible(target):
    tok, model = target
    new = _greedy(tok, model, [{"role": "user", "content": "Count from 21 to 30."}], 60)
    text = tok.decode(new, skip_special_tokens=True)
    assert "21, 22, 23, 24, 25, 26, 27, 28, 29, 30.\nThat is 10 numbers." in text, text
    assert new[-1].item() == tok.eos_token_id, "the answer should end with <|im_end|>"


@pytest.mark.slow
def test_greedy_answers_heldout_prompts(target):
    """The target solves unseen prompts (first turns of held-out conversations) word for word."""
    tok, model = target
    held = read_jsonl(DATA / "heldout.jsonl")[:10]
    firsts = [next(i for i, m in enumerate(r["messages"]) if m["role"] == "assistant") for r in held]
    # one left-padded batch: a tenth of the forwards of prompt-by-prompt decoding
    tok.padding_side = "left"
    ids = tok.apply_chat_template([r["messages"][:f] for r, f in zip(held, firsts)], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True, padding=True)
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=200, do_sample=False, pad_token_id=tok.pad_token_id)
    replies = tok.batch_decode(gen[:, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    exact = sum(reply == r["messages"][f]["content"] for reply, r, f in zip(replies, held, firsts))
    assert exact >= 7, f"only {exact}/10 held-out answers reproduced exactly"
