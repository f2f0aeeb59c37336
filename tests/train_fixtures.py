"""Stores for the training-side tests: a tiny random-init target over *repetitive* conversations.

The tiny target is first taught to count ("one two three ...", a few seconds of training), so that its
lm_head and hidden states carry structure like a real target's: a drafter trained on the store must then
show falling loss and rising acceptance length within a few dozen steps.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from helpers import make_tiny_target

CYCLE = "one two three four five six seven eight nine ten".split()


def counting_conversations(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        s, L = rng.randrange(len(CYCLE)), rng.randint(10, 50)
        answer = " ".join(CYCLE[(s + j) % len(CYCLE)] for j in range(L))
        rows.append({"messages": [{"role": "user", "content": "count from " + CYCLE[s]},
                                  {"role": "assistant", "content": answer}]})
    return rows


def teach_counting(target: Path, rows: list[dict], steps: int = 30, seed: int = 0) -> Path:
    """Train the tiny target in place on the conversations (plain next-token loss) and save it again."""
    import torch
    import transformers

    torch.manual_seed(seed)
    tok = transformers.AutoTokenizer.from_pretrained(target)
    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    texts = [tok.apply_chat_template(r["messages"], tokenize=False) for r in rows[:24]]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        loss = model(**enc, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval().save_pretrained(target)
    return target


def build_counting_store(tmp: Path, n: int = 48, layers=(1, 2), topk: int = 4, teach: bool = True,
                         final_hidden: bool = False, hidden_dtype: str = "bf16") -> tuple[Path, Path]:
    """(target dir, store dir): stage one run for real (dflash.precompute.run) over counting conversations."""
    tmp = Path(tmp)
    rows = counting_conversations(n)
    target = make_tiny_target(tmp)
    if teach:
        teach_counting(target, rows)
    data = tmp / "counting.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    store = tmp / "store"
    from dflash.config import PrecomputeConfig
    from dflash.precompute.run import run_precompute

    run_precompute(PrecomputeConfig(target=str(target), data=str(data), out=str(store), shards=1, gpus="cpu",
                                    max_length=256, topk=topk, target_layers=list(layers), final_hidden=final_hidden,
                                    hidden_dtype=hidden_dtype, writer="thread"))
    return target, store
