"""Stores for the training-side tests: a tiny random-init target over *repetitive* conversations.

A random target has no knowledge to distil, but when the assistant counts "one two three ..." the next
tokens follow from the current one, so a drafter trained on the store must show falling loss and rising
acceptance length within a few dozen steps.
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


def build_counting_store(tmp: Path, n: int = 48, layers=(1, 2), topk: int = 4) -> tuple[Path, Path]:
    """(target dir, store dir): stage one run for real (dflash.precompute) over counting conversations."""
    tmp = Path(tmp)
    target = make_tiny_target(tmp)
    data = tmp / "counting.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in counting_conversations(n)))
    store = tmp / "store"
    from dflash.config import PrecomputeConfig
    from dflash.precompute import run_precompute

    run_precompute(PrecomputeConfig(target=str(target), data=str(data), out=str(store), shards=1, gpus="cpu",
                                    max_length=256, topk=topk, target_layers=list(layers)))
    return target, store
