"""`dflash generate`'s in-process rate on a target of SmolLM2-135M's shape: the dynamic KV cache against
the static one (`--static-cache on`, which transformers' generate compiles into CUDA graphs on a GPU).

    python bench/generate_rate.py --rows 256 --batch-size 128 --max-new-tokens 256 --modes off,on

The target is random-weight Llama of SmolLM2-135M-Instruct's shape (30 layers, hidden 576, 9 heads, 3 KV
heads, vocabulary 49,152, tied embeddings) with the real tokenizer (tests/assets/smollm2-tokenizer); its
generation config's eos is a token it never picks, so every reply runs to --max-new-tokens and the
work is the same in every mode.  Prompts are --rows first exchanges of 40 to --max-words words.  Each
mode runs twice in one process: the first pass pays for compilation, the second is the steady rate.
Prints one JSON line per pass; `--out` writes them all.

The real target and conversations (benchmarks/generate-static-cache-smollm2-h100-2026-12-06.md):

    python bench/generate_rate.py --target model --data data/train.jsonl --rows 512 --max-prompt-tokens 200 \
        --batch-size 64 --temperature 0.8 --passes 1 --modes on,off:256,off,hf@file

Continuous batching (`cb`, `--continuous-batching on`: rows refilled as they finish, one ring-shaped cache
and one decode graph a width) against transformers' own (`hfcb`, `model.generate_batch`, its paged cache):

    python bench/generate_rate.py --target model --data data/prompts.jsonl --rows 1500 --samples 2 \
        --temperature 0.8 --passes 1 --modes cb:128,cb:512,hfcb --limit 512:320,1024:320

`--samples N` sends every prompt N times (as `dflash generate --samples N`: the copies are rows of their
own); `--limit ROWS:LENGTH,...` times the bare decode step (one graph replay, every row decoding over a
ring of LENGTH slots; the eager step on a CPU): the card's limit for the model at that batch. `--copy-keys`
runs attention as transformers before 5.23 did (keys and values copied once per query head). A `cb` record lists each width's
rows, ring length, decode steps and seconds.

`--target` takes a checkpoint instead of the random one (its own eos, so replies end where it ends
them), `--data` the first user turns of a conversations file. The rows go through `dflash generate`'s
own loop (windows of four batches, a journal), shortest prompt first (`--order length`, as it takes
them) or in file order (`--order file`: each window then mixes widths, as `dflash generate` did before
it sorted rows). A mode is `off`, `on` (this package's static cache: one per width, reset
between batches) or `hf` (transformers' own static cache, a new one per `generate` call, sized to the
longest seen so far, as `dflash generate` did before it kept one cache a width), then `:ROWS` for another batch size and `@ORDER` for
another order, e.g. `hf@file`. Each record lists every batch's rows, width, cache shape and seconds,
so compiling, recording and replaying show apart; `--out` gets each record as its pass ends.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash.config import GenerateConfig  # noqa: E402
from dflash.generate.drive import drive  # noqa: E402
from dflash.generate.journal import Journal  # noqa: E402
from dflash.generate.local import LocalEngine, Request  # noqa: E402
from dflash.generate.rows import plan_row  # noqa: E402

# the same script times an older checkout's code (the baseline), whose config has no such option
CONTINUOUS = "continuous_batching" in GenerateConfig.__dataclass_fields__
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


def prompts(n: int, max_words: int, data: str | None, fits=None, whole: bool = False) -> list[Request]:
    if data:  # first user turns, as `dflash generate --turns last` sends a first exchange; `fits` filters
        reqs = []
        with open(data) as f:
            for line in f:
                msgs = json.loads(line)["messages"]
                r = Request(len(reqs), msgs if whole else msgs[:1])
                if fits is None or fits(r):
                    reqs.append(r)
                if len(reqs) == n:
                    break
        return reqs
    rng = random.Random(0)
    return [Request(i, [{"role": "user", "content": " ".join(rng.choice(WORDS)
                                                             for _ in range(rng.randint(40, max_words)))}])
            for i in range(n)]


def with_samples(reqs: list[Request], samples: int) -> list[Request]:
    """Every prompt `samples` times, sample-major, each copy a row (key) of its own."""
    n = len(reqs)
    return [Request(k * n + i, r.messages) for k in range(samples) for i, r in enumerate(reqs)]


def run_hf_cb(eng, cfg, reqs) -> tuple[int, list[dict]]:
    """transformers' continuous batching (`generate_batch`) over the same prompts: new tokens up to EOS."""
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=cfg.max_new_tokens, do_sample=cfg.temperature > 0,
                           temperature=cfg.temperature or None, top_p=cfg.top_p, eos_token_id=sorted(eng.eos),
                           pad_token_id=eng.pad)
    out = eng.model.generate_batch([eng.encode(r.messages) for r in reqs], generation_config=gen)
    tokens = 0
    for res in out.values():
        ids = list(res.generated_tokens)
        stop = next((j for j, t in enumerate(ids) if t in eng.eos), None)
        tokens += len(ids) if stop is None else stop + 1
    return tokens, [{"requests": len(out)}]


def decode_limit(eng, rows: int, length: int, steps: int = 50) -> dict:
    """The bare decode step of `rows` rows over rings of `length` slots: one graph replay each on CUDA, the
    eager step elsewhere."""
    from dflash.generate.refill import Ring

    cuda = eng.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ring = Ring(eng, rows, 64, length)
    ring.step(rows)
    sync()
    t = time.perf_counter()
    with torch.no_grad():
        for _ in range(steps):
            ring.graphs[rows].replay() if cuda else ring._step(rows)
    sync()
    s = (time.perf_counter() - t) / steps
    return {"limit_rows": rows, "ring_length": length, "step_ms": round(s * 1e3, 3),
            "tokens_per_s": round(rows / s, 1), "dtype": str(eng.model.dtype)}


def widths_timed(records: list[dict]):
    """Wraps the continuous decoder so that each width's rows, ring, steps and seconds are recorded."""
    from dflash.generate import refill

    inner = refill.decode_width

    def timed(engine, ring, items, on_done):
        steps, step = [0], ring.step

        def counted(b):
            steps[0] += 1
            return step(b)

        ring.step = counted
        t = time.perf_counter()
        inner(engine, ring, items, on_done)
        records.append({"width": ring.width, "rows": ring.rows, "length": ring.length, "items": len(items),
                        "steps": steps[0], "s": round(time.perf_counter() - t, 3)})

    refill.decode_width = timed
    return lambda: setattr(refill, "decode_width", inner)


class PerCallCache(LocalEngine):
    """transformers' own static cache (a new one per `generate` call): the engine's cache argument
    becomes `cache_implementation="static"`."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.cache_kwarg = "cache_implementation"

    def _static_cache(self, rows: int, length: int) -> str:
        # transformers sizes its cache to the longest length any earlier call asked for
        self._cache_shape = (rows, max(length, getattr(self.model, "_previous_max_cache_length", -1)))
        return "static"


def run_pass(eng, cfg, reqs, order: str) -> tuple[int, list[dict]]:
    """The rows through `dflash generate`'s own loop (windows of 4 batches, journalled), shortest prompt
    first or in file order; returns the new tokens and every batch's rows, cache shape and seconds."""
    rows = [{"messages": r.messages} for r in reqs]
    plans = [plan_row(row, i, "bench", "last") for i, row in enumerate(rows)]
    batches, inner, tokens = [], eng._batch, [0]

    def timed(prompts, seed):
        t = time.perf_counter()
        out = inner(prompts, seed)
        if eng.device.type == "cuda":
            torch.cuda.synchronize()
        batches.append({"rows": len(prompts), "cache": list(eng._cache_shape or ()) if eng.static else [],
                        "width": max(len(p) for p in prompts), "s": round(time.perf_counter() - t, 3)})
        return out

    eng._batch = timed
    undo = widths_timed(batches) if getattr(eng, "continuous", False) else (lambda: None)
    with tempfile.TemporaryDirectory() as work:
        journal = Journal(Path(work), 0)
        drive(eng, cfg, rows, plans, journal, lambda n, t: tokens.__setitem__(0, tokens[0] + t),
              ordered=order == "length")
        journal.close()
    undo()
    eng._batch = inner
    return tokens[0], batches


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
    ap.add_argument("--conversation", action="store_true",
                    help="with --data: whole conversations, the last reply regenerated (the held-out replies)")
    ap.add_argument("--samples", type=int, default=1, help="every prompt this many times, each a row of its own")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--limit", default="", help="ROWS:LENGTH,...: the bare decode step's rate at these shapes")
    ap.add_argument("--limit-steps", type=int, default=50, help="decode steps timed at each --limit shape")
    ap.add_argument("--copy-keys", action="store_true",
                    help="attention as transformers before 5.23 ran it: keys and values copied per query head")
    ap.add_argument("--max-prompt-tokens", type=int, help="with --data: only prompts of at most this many tokens")
    ap.add_argument("--order", choices=["length", "file"], default="length",
                    help="rows shortest prompt first, as `dflash generate` takes them, or in file order")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--work", default="/tmp/generate_rate")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.copy_keys:  # transformers' sdpa packs a one-token query onto the key/value heads unless compiling
        from transformers.integrations import sdpa_attention

        sdpa_attention.is_torchdynamo_compiling = lambda: True
    target = Path(a.target) if a.target else build_target(Path(a.work) / "target", a.layers)
    fits = None
    if a.max_prompt_tokens:
        from dflash.target_model.capture import load_tokenizer

        tok = load_tokenizer(str(target), False)
        def fits(r: Request) -> bool:
            text = tok.apply_chat_template(r.messages, tokenize=False, add_generation_prompt=True)
            return len(tok(text, add_special_tokens=False)["input_ids"]) <= a.max_prompt_tokens
    reqs = with_samples(prompts(a.rows, a.max_words, a.data, fits, a.conversation), a.samples)
    if a.out:
        Path(a.out).write_text("")  # a record is appended as each pass ends: a run cut short keeps its passes
    for spec in filter(None, a.modes.split(",")):
        spec, _, order = spec.partition("@")
        mode, _, rows = spec.partition(":")
        bs, order = int(rows or a.batch_size), order or a.order
        kw = {"continuous_batching": "on" if mode == "cb" else "off"} if CONTINUOUS else {}
        cfg = GenerateConfig(target=str(target), gpus=a.device, batch_size=bs, max_new_tokens=a.max_new_tokens,
                             static_cache="off" if mode in ("off", "cb", "hfcb") else "on", temperature=a.temperature,
                             dtype=a.dtype, **kw)
        eng = (PerCallCache if mode == "hf" else LocalEngine)(cfg, a.device)
        for p in range(a.passes):
            if a.device.startswith("cuda"):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            toks, batches = run_hf_cb(eng, cfg, reqs) if mode == "hfcb" else run_pass(eng, cfg, reqs, order)
            wall = time.perf_counter() - t
            rec = {"mode": mode, "static_cache": cfg.static_cache, "samples": a.samples, "order": order, "pass": p + 1, "rows": len(reqs),
                   "new_tokens": toks, "wall_s": round(wall, 2), "tokens_per_s": round(toks / wall, 1),
                   "rows_per_s": round(len(reqs) / wall, 2), "batch_size": bs, "max_new_tokens": a.max_new_tokens,
                   "temperature": a.temperature, "seed": cfg.seed, "target": a.target or "random", "device": a.device,
                   "prompt_tokens_max": max(len(eng.encode(r.messages)) for r in reqs), "batches": batches}
            if a.device.startswith("cuda"):
                rec["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                rec["gpu"] = torch.cuda.get_device_name()
            emit(rec, a.out)
        del eng
    for shape in filter(None, a.limit.split(",")):
        rows, length = map(int, shape.split(":"))
        cfg = GenerateConfig(target=str(target), gpus=a.device, continuous_batching="on", dtype=a.dtype,
                             temperature=a.temperature)
        eng = LocalEngine(cfg, a.device)
        emit({"mode": "limit", **decode_limit(eng, rows, length, a.limit_steps), "temperature": a.temperature,
              "target": a.target or "random", "copy_keys": a.copy_keys,
              "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"}, a.out)
        del eng


def emit(rec: dict, out: str | None) -> None:
    print(json.dumps({k: v for k, v in rec.items() if k != "batches"}), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
