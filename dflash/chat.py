"""Datasets of conversations -> token ids and assistant loss masks, exactly as the chat template renders them.

Reading: local json/jsonl/parquet/arrow files (a file, a directory of them, or a glob) or a directory
written by `datasets.save_to_disk`.  JSON-lines files are pre-scanned line by line because the errors
of `datasets`' json loader do not say which line is broken.

Formats: `messages` ([{role, content}]), ShareGPT `conversations` ([{from, value}]) or `prompt`/`response`.

Loss mask: the supervised characters of assistant turn i are what the template adds between
`render(messages[:i], add_generation_prompt=True)` and `render(messages[:i+1])`: the turn's content and
its end-of-turn token (`<|im_end|>`, `<|eot_id|>`), not the role header.  This needs no `{% generation %}`
tags.  Templates that render earlier turns differently once later turns exist (Qwen3 drops earlier
<think> blocks) break the prefix property; for those turns the content is located in the full render
by character search instead.  Characters map to tokens through the fast tokenizer's offsets.
"""

from __future__ import annotations

import glob
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash.errors import DataError, RowError
from dflash.jsonl import jsonl_lines, without_broken_lines

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow"}
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}


# ---------------------------------------------------------------------------------------------- reading


def data_files(path: str | Path) -> list[Path]:
    """The data files behind `path` (a file, a directory of files, or a glob), sorted; [] for a saved dataset."""
    p = Path(path)
    if p.is_dir():
        if _is_saved_dataset(p):
            return []
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in FILE_BUILDERS)
        if not files:
            raise DataError(
                f"dataset directory {p} holds no .json/.jsonl/.parquet/.arrow files and is not a saved "
                "`datasets` directory; pass a data file or a directory written by Dataset.save_to_disk."
            )
        return files
    if p.is_file():
        if p.suffix not in FILE_BUILDERS:
            raise DataError(f"dataset file {p} has an unknown extension; use .json, .jsonl, .parquet or .arrow.")
        return [p]
    matches = sorted(Path(m) for m in glob.glob(str(path)) if Path(m).is_file() and Path(m).suffix in FILE_BUILDERS)
    if not matches:
        raise DataError(f"dataset {path} does not exist; pass a local data file, directory or glob with --data.")
    return matches


def _is_saved_dataset(p: Path) -> bool:
    return (p / "dataset_dict.json").is_file() or (p / "state.json").is_file()


def load_rows(path: str | Path, split: str = "train", max_samples: int | None = None, check: bool = True,
              skip_bad_lines: bool = False):
    """A `datasets.Dataset` of the rows at `path` (local only).  `check=False` skips the JSON pre-scan
    (shard processes, after the launching process has checked); `skip_bad_lines`: see read_rows."""
    return read_rows(path, split, max_samples, check, skip_bad_lines)[0]


def read_rows(path: str | Path, split: str = "train", max_samples: int | None = None, check: bool = True,
              skip_bad_lines: bool = False):
    """(dataset, broken): load_rows' dataset and, by row, the RowError of each line that is not one JSON
    object.  Without `skip_bad_lines` such a line stops the run; with it, the line is a row with no
    fields, for the caller to leave out as a bad row (`--skip-bad-rows`)."""
    import tempfile

    import datasets

    p = Path(path)
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    broken: dict[int, RowError] = {}
    try:
        files = data_files(p)
        if not files:
            try:
                ds = datasets.load_from_disk(str(p))
            except Exception as e:
                raise DataError(f"saved dataset {p} cannot be loaded ({e}).") from None
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise DataError(
                        f"saved dataset {p} has no split {split!r} (it has {', '.join(ds)}); pick one with --split."
                    )
                ds = ds[split]
        else:
            kinds = {FILE_BUILDERS[f.suffix] for f in files}
            if len(kinds) > 1:
                raise DataError(f"dataset {p} mixes file types ({', '.join(sorted(kinds))}); use one type.")
            if check:
                for f in files:
                    if f.stat().st_size == 0 and f.suffix not in (".json", ".jsonl"):
                        raise DataError(f"dataset file {f} is empty; it needs at least one conversation.")
            with tempfile.TemporaryDirectory(prefix="dflash-rows-") as tmp:
                if check or skip_bad_lines:
                    files, broken = without_broken_lines(files, skip_bad_lines, tmp)
                try:
                    # a copy without the broken lines lives only as long as `tmp`: its rows are kept in memory
                    extra = {"cache_dir": tmp, "keep_in_memory": True} if broken else {}
                    ds = datasets.load_dataset(kinds.pop(), data_files=[str(f) for f in files], split="train", **extra)
                except Exception as e:  # the builders raise many types; the message is what helps
                    raise DataError(
                        f"dataset {p} cannot be read by `datasets` ({type(e).__name__}: {e}); check that every "
                        "row has the same fields with the same types."
                    ) from None
    finally:
        if bars:
            datasets.enable_progress_bars()
    if max_samples is not None:
        ds = ds.select(range(min(max_samples, len(ds))))
        broken = {r: e for r, e in broken.items() if r < len(ds)}
    if len(ds) == 0:
        raise DataError(f"dataset {p} has no rows; it needs at least one conversation.")
    return ds, broken


def row_locator(path: str | Path):
    """A function of a dataset row giving {file, line} for rows of JSON-lines files ({file} for a single
    file of another kind, {} for a saved dataset): rows are the files' non-blank lines, in file order."""
    files = data_files(path)
    spans = []  # (file, first row, line number of each row or None)
    first = 0
    for f in files:
        if f.suffix == ".jsonl" or (f.suffix == ".json" and not _is_one_document(f)):
            lines = [n for n, line in enumerate(jsonl_lines(f.read_text(encoding="utf-8")), 1) if line.strip()]
            spans.append((str(f), first, lines))
            first += len(lines)
        else:
            spans.append((str(f), first, None))

    def locate(row: int) -> dict:
        for f, start, lines in reversed(spans):
            if row >= start:
                if lines is None:
                    return {"file": f} if len(spans) == 1 else {}
                return {"file": f, "line": lines[row - start]} if row - start < len(lines) else {}
        return {}

    return locate


def _is_one_document(f: Path) -> bool:
    try:
        json.loads(f.read_text(encoding="utf-8"))
        return True
    except ValueError:
        return False


def dataset_fingerprint(path: str | Path, split: str = "train", max_samples: int | None = None) -> str:
    """sha256 of the data files' bytes (or the saved dataset's own fingerprint), split and row limit."""
    p = Path(path)
    h = hashlib.sha256(json.dumps({"split": split, "max_samples": max_samples}).encode())
    files = data_files(p)
    if not files:
        import datasets

        ds = datasets.load_from_disk(str(p))
        parts = [ds[split]] if isinstance(ds, datasets.DatasetDict) and split in ds else [ds]
        h.update(str([getattr(d, "_fingerprint", None) for d in parts]).encode())
        return h.hexdigest()
    for f in files:
        h.update(f.name.encode())
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------- formats


def _text(value, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI-style content parts: keep the text ones
        if all(isinstance(v, dict) for v in value):
            return "".join(str(v.get("text") or "") for v in value if v.get("type", "text") == "text")
    if value is None:
        return ""
    raise RowError(f"{where}: content is a {type(value).__name__}, expected a string; fix the dataset.",
                   "content not a string")


def conversation_of(row: dict, row_idx: int, path) -> list[dict]:
    """The row as [{role, content}], from `messages`, ShareGPT `conversations` or `prompt`/`response`."""
    where = f"dataset {path}, row {row_idx}"
    if row.get("messages") is not None:
        turns = row["messages"]
        if not isinstance(turns, list) or not turns:
            raise RowError(f"{where}: `messages` must be a non-empty list of {{role, content}} objects.",
                           "no turns")
        out = []
        for j, m in enumerate(turns):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise RowError(f"{where}: messages[{j}] has no string `role`; each message needs role and content.",
                               "turn without role")
            out.append({"role": m["role"], "content": _text(m.get("content"), f"{where}, messages[{j}]")})
        return out
    if row.get("conversations") is not None:
        turns = row["conversations"]
        if not isinstance(turns, list) or not turns:
            raise RowError(f"{where}: `conversations` must be a non-empty list of {{from, value}} objects.",
                           "no turns")
        out = []
        for j, m in enumerate(turns):
            if not isinstance(m, dict):
                raise RowError(f"{where}: conversations[{j}] is not an object with `from` and `value`.",
                               "turn not an object")
            who = m.get("from", m.get("role"))
            role = SHAREGPT_ROLES.get(str(who).lower()) if who is not None else None
            if role is None:
                raise RowError(
                    f"{where}: conversations[{j}] has from={who!r}; ShareGPT turns must come from "
                    f"{', '.join(sorted(SHAREGPT_ROLES))}.", "unknown role"
                )
            value = m.get("value", m.get("content"))
            out.append({"role": role, "content": _text(value, f"{where}, conversations[{j}]")})
        return out
    if row.get("prompt") is not None and row.get("response") is not None:
        out = [{"role": "system", "content": _text(row["system"], where)}] if row.get("system") else []
        out.append({"role": "user", "content": _text(row["prompt"], f"{where}, prompt")})
        out.append({"role": "assistant", "content": _text(row["response"], f"{where}, response")})
        return out
    present = sorted(k for k, v in row.items() if v is not None)
    raise RowError(
        f"{where}: unknown conversation format (fields found: {', '.join(present) or 'none'}). Give each row "
        "`messages` ([{role, content}]), ShareGPT `conversations` ([{from, value}]) or `prompt` and `response`.",
        "unknown format",
    )


def conversation_key(messages: list[dict]) -> bytes:
    """16 bytes identifying a conversation by its content (roles and texts as conversation_of gives them),
    whatever its row, file or format: what `precompute --append` matches a grown dataset on."""
    canon = json.dumps(messages, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.blake2b(canon.encode(), digest_size=16).digest()


# ---------------------------------------------------------------------------------------------- rendering


@dataclass
class Rendered:
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool


def _template(tokenizer, messages, add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _try_template(tokenizer, messages, add_generation_prompt: bool = False) -> str | None:
    try:
        return _template(tokenizer, messages, add_generation_prompt)
    except Exception:  # a template may refuse a prefix (e.g. no messages, or one not ending with a user)
        return None


def _generation_prompt(tokenizer, messages) -> str:
    """The assistant header the template appends for generation ("<|im_start|>assistant\\n")."""
    bare, prompted = _try_template(tokenizer, messages), _try_template(tokenizer, messages, True)
    if bare is None or prompted is None or not prompted.startswith(bare):
        return ""
    return prompted[len(bare) :].strip()


def _content_candidates(content: str) -> list[str]:
    """How a template may have rewritten an assistant content: as is, trimmed, or without its <think> part."""
    cands = [content, content.strip()]
    if "</think>" in content:
        cands.append(content.split("</think>")[-1].strip())
    seen = []
    for c in cands:
        if c and c not in seen:
            seen.append(c)
    return seen


def _locate(full: str, content: str, cursor: int) -> tuple[int, str] | None:
    for cand in _content_candidates(content):
        pos = full.find(cand, cursor)
        if pos >= 0:
            return pos, cand
    return None


def assistant_spans(tokenizer, messages: list[dict], full: str, where: str = "this conversation"):
    """Character spans [start, end) of `full` (the whole render) that the assistant generates."""
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            # Move past this message's own text so that an assistant reply is never found inside it.
            hit = _locate(full, m["content"], cursor) if m["content"] else None
            if hit is not None:
                cursor = hit[0] + len(hit[1])
            continue
        before, upto = _try_template(tokenizer, messages[:i], True), _try_template(tokenizer, messages[: i + 1])
        if None not in (before, upto) and upto.startswith(before) and full.startswith(upto) and len(before) >= cursor:
            start, end = len(before), len(upto)
        else:
            # The template renders this turn differently inside the full conversation (Qwen3 strips
            # earlier <think> blocks): find the content, then the end-of-turn text that follows it.
            header = _generation_prompt(tokenizer, messages[:i])
            if header and full.find(header, cursor) >= 0:
                cursor = full.find(header, cursor) + len(header)
            hit = _locate(full, m["content"], cursor)
            if hit is None:
                if not m["content"].strip():
                    continue
                raise RowError(
                    f"{where}: cannot locate assistant turn {i} in the chat template's render: rendering the "
                    "conversation turn by turn does not give prefixes of the full render, and the turn's "
                    "content does not appear in it. The loss mask cannot be derived from this template; "
                    "fix the chat template or drop this conversation.", "reply not found in render"
                )
            start, cand = hit
            end = start + len(cand)
            if upto is not None and upto.rfind(cand) >= 0:
                suffix = upto[upto.rfind(cand) + len(cand) :].rstrip()
                if suffix and full.startswith(suffix, end):
                    end += len(suffix)
        # The template's separator after the end-of-turn token ("\n" after <|im_end|>) is not generated.
        end = start + len(full[start:end].rstrip())
        if end > start:
            spans.append((start, end))
            cursor = end
    return spans


def check_renders(tokenizer, messages: list[dict], where: str = "this conversation") -> bool:
    """What `render` could reject, without tokenizing: the chat template renders the conversation and its
    assistant replies are found in the render.  True when some assistant text is there to supervise."""
    try:
        full = _template(tokenizer, messages)
    except Exception as e:
        raise RowError(f"{where}: the chat template cannot render this conversation ({type(e).__name__}: {e}).",
                       "template refuses") from None
    return any(e > s for s, e in assistant_spans(tokenizer, messages, full, where))


def render(tokenizer, messages: list[dict], max_length: int, where: str = "this conversation") -> Rendered:
    """Token ids of the chat-template render and a 0/1 mask of the assistant's tokens, cut to max_length."""
    try:
        full = _template(tokenizer, messages)
    except Exception as e:
        raise RowError(f"{where}: the chat template cannot render this conversation ({type(e).__name__}: {e}).",
                       "template refuses") from None
    spans = assistant_spans(tokenizer, messages, full, where)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    # A token is supervised when any of its characters is: prefix sums of a per-character mask.
    chars = np.zeros(len(full) + 1, dtype=np.int64)
    for s, e in spans:
        chars[s:e] = 1
    csum = np.concatenate([[0], np.cumsum(chars)])
    mask = ((csum[offsets[:, 1]] - csum[offsets[:, 0]]) > 0).astype(np.int64).tolist() if len(ids) else []
    truncated = len(ids) > max_length
    return Rendered(ids[:max_length], mask[:max_length], truncated)
