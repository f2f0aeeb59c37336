"""The online/held-out gap split by prompt: each online eval's `online.per_prompt` (dflash eval) joined to
the held-out conversation it came from, and tau (accepted tokens per verify step, pooled over prompts)
by user turns in the prompt and by the prompt's length.

    python3 gap.py HELDOUT.jsonl EVAL.json [EVAL.json ...]
"""

from __future__ import annotations

import json
import sys


def pooled(rows: list[dict]) -> float | None:
    rows = [r for r in rows if r["steps"]]
    steps = sum(r["steps"] for r in rows)
    return sum(r["tau"] * r["steps"] for r in rows) / steps if steps else None


def user_turns(conv: dict) -> int:
    msgs = conv["messages"]
    last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    return sum(m["role"] == "user" for m in msgs[:last])


def split(per_prompt: list[dict], heldout: list[dict]) -> dict:
    for r in per_prompt:
        r["turns"] = user_turns(heldout[r["row"]])
    groups = {
        "all": per_prompt,
        "1 user turn": [r for r in per_prompt if r["turns"] == 1],
        "2+ user turns": [r for r in per_prompt if r["turns"] >= 2],
        "prompt < 512 tokens": [r for r in per_prompt if r["prompt_tokens"] < 512],
        "prompt 512-1,499": [r for r in per_prompt if 512 <= r["prompt_tokens"] < 1500],
        "prompt >= 1,500": [r for r in per_prompt if r["prompt_tokens"] >= 1500],
    }
    return {k: {"prompts": len(v), "tau": round(pooled(v), 3) if v else None} for k, v in groups.items()}


def main() -> None:
    heldout = [json.loads(x) for x in open(sys.argv[1], encoding="utf-8") if x.strip()]
    out = {}
    for path in sys.argv[2:]:
        on = json.load(open(path))["online"]
        out[path.rsplit("/", 1)[-1]] = {"tau": round(on["tau"], 3), **split(on["per_prompt"], heldout)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
