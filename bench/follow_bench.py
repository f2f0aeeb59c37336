"""Both stages at once on one GPU: `dflash precompute --append` growing a store while `dflash train --follow`
trains from it (issue 20), at the Qwen3-8B shape: a random-init Qwen3-8B-shaped target (all 36 layers, saved
with save_pretrained) and a 5-layer drafter, block 16, 4 rows of 4096 tokens per micro-batch, 64 anchors.

1. precompute alone over the whole dataset (the GPU to itself), and over its first `--initial` rows: the
   difference of the two gives the steady capture rate, start-up excluded; both stores are then deleted;
2. the trainer starts first (`--follow`, no store yet); precompute captures the first `--initial` rows;
   the trainer compiles and trains on them;
3. once it has logged `--warm-steps` steps, `precompute --append` captures the rest of the dataset while the
   trainer trains; the driver notes when each metrics row was logged, so the trainer's steps split into
   "before", "while the append ran" and "after";
4. the trainer is stopped `--after-s` seconds after the append ends.

    python bench/follow_bench.py [--tiny] [--conversations N] -> $OUT/follow.json

`--tiny` runs the same on a CPU with the tests' tiny target.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common import QWEN3_8B, ROOT, Results, out_dir, tiny_mode, work_dir
from dflash.jsonl import jsonl_lines

sys.path.insert(0, str(ROOT / "tests"))


def make_target(path: Path, tiny: bool) -> Path:
    """A random-init Qwen3-8B-shaped checkpoint (every layer: precompute runs the whole forward)."""
    import torch
    import transformers

    from helpers import make_tiny_target, make_tokenizer

    if tiny:
        return make_tiny_target(path.parent, name=path.name)
    tok = make_tokenizer("qwen3")
    d = QWEN3_8B
    cfg = transformers.Qwen3Config(
        hidden_size=d["hidden_size"], num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=d["num_attention_heads"], num_key_value_heads=d["num_key_value_heads"],
        head_dim=d["head_dim"], intermediate_size=d["intermediate_size"], vocab_size=d["vocab_size"],
        max_position_embeddings=40960, tie_word_embeddings=False, torch_dtype="bfloat16",
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


def make_data(path: Path, n: int, tiny: bool) -> Path:
    """Chat-like conversations of a few hundred to a few thousand tokens (random words)."""
    from helpers import _WORDS

    rng = random.Random(0)
    lo, hi = (5, 40) if tiny else (200, 2500)
    with path.open("w") as f:
        for _ in range(n):
            def text(k):
                return " ".join(rng.choice(_WORDS) for _ in range(k))
            words = int(min(hi, max(lo, rng.lognormvariate(6.3 if not tiny else 2.5, 0.6))))
            f.write(json.dumps({"messages": [{"role": "user", "content": text(max(3, words // 6))},
                                             {"role": "assistant", "content": text(words)}]}) + "\n")
    return path


def _lines(p: Path) -> int:
    try:
        return sum(1 for _ in p.open())
    except FileNotFoundError:
        return 0


def _wait_for(cond, proc, log: Path, what: str, timeout: float = 900) -> None:
    t0 = time.time()
    while not cond():
        assert proc.poll() is None, f"the trainer ended while waiting for {what}: {log.read_text()[-3000:]}"
        assert time.time() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--conversations", type=int, default=0)
    ap.add_argument("--initial", type=int, default=0, help="rows captured before the trainer starts training")
    ap.add_argument("--warm-steps", type=int, default=20)
    ap.add_argument("--after-s", type=float, default=20)
    ap.add_argument("--hidden-dtype", default="bf16")
    a = ap.parse_args()
    tiny = tiny_mode(a.tiny)
    n = a.conversations or (60 if tiny else 2000)
    first_n = a.initial or (10 if tiny else 100)
    res = Results("follow", tiny=tiny, conversations=n, initial=first_n, hidden_dtype=a.hidden_dtype)
    w = work_dir()
    shutil.rmtree(w, ignore_errors=True)
    w.mkdir(parents=True)
    t = time.perf_counter()
    target = make_target(w / "target", tiny)
    data = make_data(w / "chats.jsonl", n, tiny)
    initial = w / "initial.jsonl"
    initial.write_text("".join(line + "\n" for line in jsonl_lines(data.read_text())[:first_n]))
    res.set("setup_s", round(time.perf_counter() - t, 1))
    gpus = "cpu" if tiny else "0"
    layers = "1,2" if tiny else ",".join(map(str, QWEN3_8B["target_layer_ids"]))
    store = w / "store"
    pc = [sys.executable, "-m", "dflash.cli", "precompute", "--target", str(target), "--gpus", gpus,
          "--target-layers", layers, "--max-length", "256" if tiny else "4096", "--hidden-dtype", a.hidden_dtype]
    tr = [sys.executable, "-m", "dflash.cli", "train", "--store", str(store), "--target", str(target),
          "--out", str(w / "run"), "--gpus", "cpu:1" if tiny else "0", "--follow", "--follow-poll", "1",
          "--steps", "100000", "--block-size", "16", "--num-layers", "2" if tiny else "5",
          "--token-budget", "512" if tiny else "4096", "--num-anchors", "8" if tiny else "64",
          "--rows-per-batch", "1" if tiny else "4", "--num-workers", "1" if tiny else "4", "--lr", "6e-4"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = out_dir()

    def precompute(d: Path, into: Path, *extra) -> dict:
        t = time.time()
        p = subprocess.run(pc + ["--data", str(d), "--out", str(into), *extra], env=env, capture_output=True,
                           text=True, cwd=w)
        assert p.returncode == 0, p.stderr[-3000:]
        return {"wall_s": round(time.time() - t, 1), "line": p.stdout.strip().splitlines()[-1], **_store_rate(into)}

    whole, part = precompute(data, w / "alone"), precompute(initial, w / "alone_initial")
    shutil.rmtree(w / "alone")
    shutil.rmtree(w / "alone_initial")
    steady = (whole["tokens"] - part["tokens"]) / (whole["shard_wall_s"] - part["shard_wall_s"])
    res.set("precompute_alone", {"whole": whole, "initial": part, "steady_tokens_per_s": round(steady)})

    tlog = out / "follow_train.log"
    with tlog.open("w") as f:
        trainer = subprocess.Popen(tr, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=w)
    metrics = w / "run" / "metrics.jsonl"
    marks = []  # (seconds since the append started, metrics rows logged so far)
    try:
        _wait_for(lambda: "waiting for store" in tlog.read_text(), trainer, tlog, "the waiting line")
        res.set("precompute_initial", precompute(initial, store))
        _wait_for(lambda: _lines(metrics) >= a.warm_steps, trainer, tlog, "the warm-up steps")
        t0 = time.time()
        before = _lines(metrics)
        with (out / "follow_append.log").open("w") as f:
            writer = subprocess.Popen(pc + ["--data", str(data), "--out", str(store), "--append"], env=env,
                                      stdout=f, stderr=subprocess.STDOUT, cwd=w)
        while writer.poll() is None:
            marks.append((round(time.time() - t0, 2), _lines(metrics)))
            time.sleep(0.5)
        t_end = time.time() - t0
        during = _lines(metrics)
        res.set("append", {"rc": writer.returncode, "wall_s": round(t_end, 1), **_store_rate(store, part=1)})
        time.sleep(a.after_s)
        marks.append((round(time.time() - t0, 2), _lines(metrics)))
    finally:
        trainer.kill()
        trainer.wait()
    rows = [json.loads(x) for x in jsonl_lines(metrics.read_text())]
    res.set("train", {"before_append": rate(rows[a.warm_steps // 2 : before]), "while_append": rate(rows[before:during]),
                      "after_append": rate(rows[during:]), "marks_every_s": 0.5, "marks": marks[::4]})
    shutil.copy(metrics, out / "follow_metrics.jsonl")


def rate(rs: list[dict]) -> dict | None:
    """Steps, rates and data wait of a run of metrics rows (each row's own interval: tokens / tokens-per-s)."""
    if not rs:
        return None
    sec = sum(r["ctx_tokens"] / r["ctx_tokens_per_s"] for r in rs if r["ctx_tokens_per_s"])
    blk = sum(r["block_tokens_per_s"] * r["ctx_tokens"] / r["ctx_tokens_per_s"] for r in rs if r["ctx_tokens_per_s"])
    waits = sorted(r["data_wait_frac"] for r in rs)
    return {"steps": len(rs), "seconds": round(sec, 1), "steps_per_s": round(len(rs) / sec, 2) if sec else None,
            "ctx_tokens_per_s": round(sum(r["ctx_tokens"] for r in rs) / sec) if sec else None,
            "block_tokens_per_s": round(blk / sec) if sec else None,
            "data_wait_frac_mean": round(sum(waits) / len(waits), 4), "data_wait_frac_median": waits[len(waits) // 2],
            "epochs": [min(r["epoch"] for r in rs), max(r["epoch"] for r in rs)],
            "epoch_samples": sorted({r["epoch_samples"] for r in rs})}


def _store_rate(store: Path, part: int | None = None) -> dict:
    """Tokens stored and the shards' own wall time (model load included), of one part or the whole store."""
    from dflash.store import read_manifest

    m = read_manifest(store)
    shards = [f"shard-{i:05d}" for i in range(m["num_shards"])]
    if part is not None:
        p = m["parts"][part]
        shards = [f"shard-{i:05d}" for i in range(p["first_shard"], p["first_shard"] + p["num_shards"])]
    sh = [m["shards"][k] for k in shards]
    tok = sum(int(s.get("new_tokens") or 0) for s in sh)
    wall = max(float(s.get("wall_s") or 0) for s in sh)
    return {"tokens": tok, "shard_wall_s": wall, "tokens_per_s": round(tok / wall) if wall else None}


if __name__ == "__main__":
    main()
