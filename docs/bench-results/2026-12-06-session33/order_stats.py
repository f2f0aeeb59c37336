"""The static cache lengths `dflash generate`'s batches ask for, by row order, counted without a model.

    python docs/bench-results/2026-12-06-session33/order_stats.py MODEL_DIR TRAIN_JSONL

The prompts of the session 33 lease's `generate_4k` (the first user turn of the first 4,000 training
conversations, twice), those that fit the target's context; windows of 4 batches of 64 rows, each window
sorted by tokens as the engine sorts it; a batch's cache is `static_width` + the new tokens, and
transformers' is the running maximum of those (its `_prepare_static_cache`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from transformers import AutoTokenizer  # noqa: E402

from dflash.generate.local import static_width  # noqa: E402

ROWS, NEW, CONTEXT = 64, 256, 8192


def caches(order: list[tuple[int, int]]) -> list[int]:
    out = []
    for w in range(0, len(order), 4 * ROWS):
        window = sorted(order[w:w + 4 * ROWS])
        for b in range(0, len(window), ROWS):
            width = static_width(max(p[0] for p in window[b:b + ROWS]), NEW, CONTEXT)
            out.append(width + min(NEW, CONTEXT - width))
    return out


def main() -> None:
    tok = AutoTokenizer.from_pretrained(sys.argv[1])
    with open(sys.argv[2]) as f:
        rows = [json.loads(line) for _, line in zip(range(4000), f)]
    prompts = []  # (tokens, characters)
    for r in rows * 2:
        turn = r["messages"][:1]
        text = tok.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
        prompts.append((len(tok(text, add_special_tokens=False)["input_ids"]), len(turn[0]["content"])))
    prompts = [p for p in prompts if p[0] < CONTEXT]
    for name, order in (("file", prompts), ("characters", sorted(prompts, key=lambda p: p[1])),
                        ("tokens", sorted(prompts))):
        own = caches(order)
        hf, top = [], -1
        for c in own:
            top = max(top, c - 1)
            hf.append(top)
        print(json.dumps({"order": name, "batches": len(own), "width_changes": sum(a != b for a, b in zip(own, own[1:])),
                          "mean_cache_own": round(sum(own) / len(own)), "mean_cache_transformers": round(sum(hf) / len(hf)),
                          "transformers_max_from_batch": hf.index(max(hf)) + 1}))


if __name__ == "__main__":
    main()
