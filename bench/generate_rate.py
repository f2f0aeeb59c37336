"""`dflash generate`'s in-process rate on a target of SmolLM2-135M's shape: the dynamic KV cache against
the static one (`--static-cache on`, which transformers' generate compiles into CUDA graphs on a GPU).

    python bench/generate_rate.py --rows 256 --batch-size 128 --max-new-tokens 256 --modes off,on

The target is random-weight Llama of SmolLM2-135M-Instruct's shape (30 layers, hidden 576, 9 heads, 3 KV
heads, vocabulary 49,152, tied embeddings) with the real tokenizer (tests/assets/smollm2-tokenizer); its
generation config's eos is a token it never picks, so every reply runs to --max-new-tokens and the
work is the same in every mode.  Prompts are --rows first exchanges of 40 to --max-words words.  Each
mode runs twice in one process: the first pass pays for compilation, the second is the steady rate.
Prints one JSON line per pass; `--out` writes them all.

The real target and conversations (session 33: on them `--static-cache on` was no faster than off):

    python bench/generate_rate.py --target model --data data/train.jsonl --rows 512 --batch-size 64 \
        --temperature 0.8 --passes 1 --modes off,off:256,on,hf

`--target` takes a checkpoint instead of the random one (its own eos, so replies end where it ends
them), `--data` the first user turns of a conversations file. A mode is `off`, `on` (this package's
static cache: one per width, reset between batches) or `hf` (transformers' own static cache, a new one
per `generate` call, as before session 33), with `:ROWS` for another batch size. Each record lists
every batch's rows, cache shape and seconds, so compiling, recording and replaying show apart.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash.config import GenerateConfig  # noqa: E402
from dflash.generate.local import LocalEngine, Request  # noqa: E402

WORDS = "the a model token block anchor draft target layer cache batch store shard reply prompt".split()


def build_target(path: Path, layers: int) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(ROOT / "tests/assets/smollm2-tokenizer")
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=49151, pad_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def prompts(n: int, max_words: int, data: str | None, fits=None) -> list[Request]:
    if data:  # first user turns, as `dflash generate --turns last` sends a first exchange; `fits` filters
        reqs = []
        with open(data) as f:
            for line in f:
                r = Request(len(reqs), json.loads(line)["messages"][:1])
                if fits is None or fits(r):
                    reqs.append(r)
                if len(reqs) == n:
                    break
        return reqs
    rng = random.Random(0)
    return [Request(i, [{"role": "user", "content": " ".join(rng.choice(WORDS)
                                                             for _ in range(rng.randint(40, max_words)))}])
            for i in range(n)]


class PerCallCache(LocalEngine):
    """transformers' own static cache (a new one per `generate` call): the engine's cache argument
    becomes `cache_implementation="static"`."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.cache_kwarg = "cache_implementation"

    def _static_cache(self, rows: int, length: int) -> str:
        self._cache_shape = (rows, length)
        return "static"


def run_pass(eng, reqs, seed: int) -> tuple[list, list[dict]]:
    batches, t = [], time.perf_counter()

    def on_batch(responses):
        nonlocal t
        if eng.device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        batches.append({"rows": len(responses), "cache": list(eng._cache_shape or ()), "s": round(now - t, 3),
                        "tokens": sum(r.tokens for r in responses)})
        t = now

    return eng.generate(reqs, seed=seed, on_batch=on_batch), batches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-words", type=int, default=600)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--modes", default="off,on")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--target", help="a checkpoint to decode with (default: a random one of SmolLM2's shape)")
    ap.add_argument("--data", help="a conversations JSONL whose first user turns are the prompts")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-prompt-tokens", type=int, help="with --data: only prompts of at most this many tokens")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--work", default="/tmp/generate_rate")
    ap.add_argument("--out")
    a = ap.parse_args()
    target = Path(a.target) if a.target else build_target(Path(a.work) / "target", a.layers)
    fits = None
    if a.max_prompt_tokens:
        from dflash.target_model.capture import load_tokenizer

        tok = load_tokenizer(str(target), False)
        def fits(r: Request) -> bool:
            text = tok.apply_chat_template(r.messages, tokenize=False, add_generation_prompt=True)
            return len(tok(text, add_special_tokens=False)["input_ids"]) <= a.max_prompt_tokens
    reqs = prompts(a.rows, a.max_words, a.data, fits)
    results = []
    for spec in a.modes.split(","):
        mode, _, rows = spec.partition(":")
        bs = int(rows or a.batch_size)
        cfg = GenerateConfig(target=str(target), gpus=a.device, batch_size=bs, max_new_tokens=a.max_new_tokens,
                             static_cache="off" if mode == "off" else "on", temperature=a.temperature)
        eng = (PerCallCache if mode == "hf" else LocalEngine)(cfg, a.device)
        for p in range(a.passes):
            if a.device.startswith("cuda"):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            out, batches = run_pass(eng, reqs, seed=p)
            wall = time.perf_counter() - t
            toks = sum(r.tokens for r in out)
            rec = {"mode": mode, "static_cache": cfg.static_cache, "pass": p + 1, "rows": len(out), "new_tokens": toks,
                   "wall_s": round(wall, 2), "tokens_per_s": round(toks / wall, 1), "rows_per_s": round(len(out) / wall, 2),
                   "batch_size": bs, "max_new_tokens": a.max_new_tokens, "temperature": a.temperature,
                   "target": a.target or "random", "device": a.device,
                   "prompt_tokens_max": max(len(eng.encode(r.messages)) for r in reqs), "batches": batches}
            if a.device.startswith("cuda"):
                rec["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                rec["gpu"] = torch.cuda.get_device_name()
            print(json.dumps({k: v for k, v in rec.items() if k != "batches"}), flush=True)
            results.append(rec)
        del eng
    if a.out:
        Path(a.out).write_text("".join(json.dumps(r) + "\n" for r in results))


if __name__ == "__main__":
    main()
