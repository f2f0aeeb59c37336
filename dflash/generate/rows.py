"""A dataset row's turns, and the same row written back with its assistant turns replaced (docs/DESIGN.md §10).

The row keeps its format and every field it had: `messages` rows get new assistant `content`, ShareGPT
`conversations` rows new `value`s, `prompt`/`response` rows a new `response`.  A conversation that
ends with a user turn gets an assistant turn appended, so a dataset of prompts alone can be
regenerated too (a `prompt` row with no `response` is not a conversation chat.py reads, so that
form needs a response field, even an empty one).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from dflash.chat import conversation_of
from dflash.errors import DataError

# a row's `failed` reason when its prompt is over --max-prompt-tokens: counted as left out, not as failed
OVER_MAX_PROMPT = "prompt over --max-prompt-tokens"

TURNS = ("all", "last", "none")


@dataclass
class Plan:
    """What to generate for one row: the conversation as chat.py reads it and the assistant turns to
    (re)write, in order; an index equal to len(messages) is a turn to append."""

    row: int
    fmt: str
    messages: list[dict]
    turns: list[int]


def row_format(row: dict) -> str:
    """The format chat.conversation_of reads the row in (it tries them in this order)."""
    if row.get("messages") is not None:
        return "messages"
    if row.get("conversations") is not None:
        return "sharegpt"
    return "prompt"


def plan_row(row: dict, row_idx: int, path, turns: str) -> Plan:
    """The row's conversation and which of its assistant turns `--turns` regenerates."""
    messages = conversation_of(row, row_idx, path)
    fmt = row_format(row)
    if turns == "none":
        return Plan(row_idx, fmt, messages, [])
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if messages[-1]["role"] == "user":
        assistant.append(len(messages))
    if not assistant:
        raise DataError(
            f"dataset {path}, row {row_idx}: no assistant turn to regenerate and the conversation does not end "
            "with a user turn; give each row a user turn for the target to answer."
        )
    for i in assistant:
        if not any(m["role"] == "user" for m in messages[:i]):
            raise DataError(
                f"dataset {path}, row {row_idx}: assistant turn {i} has no user turn before it, so there is no "
                "prompt to answer; drop the row or put the user's turn first."
            )
    return Plan(row_idx, fmt, messages, assistant if turns == "all" else assistant[-1:])


def prompt_messages(messages: list[dict], turn: int) -> list[dict]:
    """The conversation the target answers at `turn`: what comes before it (earlier assistant turns
    already replaced when `--turns all` regenerated them)."""
    return [dict(m) for m in messages[:turn]]


def apply_response(messages: list[dict], turn: int, text: str) -> list[dict]:
    """The conversation with assistant turn `turn` replaced (or appended) by `text`."""
    out = [dict(m) for m in messages]
    if turn == len(out):
        out.append({"role": "assistant", "content": text})
    else:
        out[turn] = {**out[turn], "content": text}
    return out


def write_back(row: dict, plan: Plan, messages: list[dict]) -> dict:
    """`row` in its own format with the plan's turns taken from `messages` (the regenerated conversation)."""
    out = copy.deepcopy(dict(row))
    if not plan.turns:
        return out
    if plan.fmt == "prompt":
        out["response"] = messages[-1]["content"]
        return out
    key, text_key = ("messages", "content") if plan.fmt == "messages" else ("conversations", "value")
    turns = list(out[key])
    for i in plan.turns:
        if i < len(turns):
            turn = dict(turns[i])
            # ShareGPT rows that spell it `content` (chat.py reads both) keep their spelling
            use = "content" if plan.fmt == "sharegpt" and turn.get("value") is None and "content" in turn else text_key
            turn[use] = messages[i]["content"]
            turns[i] = turn
        else:
            turns.append({"role": "assistant", "content": messages[i]["content"]} if plan.fmt == "messages"
                         else {"from": "gpt", "value": messages[i]["content"]})
    out[key] = turns
    return out


__all__ = ["TURNS", "Plan", "row_format", "plan_row", "prompt_messages", "apply_response", "write_back"]
