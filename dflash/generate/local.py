"""In-process generation: continuous batching (refill.py) where the target allows it, else transformers'
`generate` over length-sorted, left-padded batches (docs/DESIGN.md §10).

Why not transformers' own continuous batching (`generate_batch` / `init_continuous_batching`): it drives
the model from a background thread of its own (the project keeps model work on a process's main thread,
DESIGN §1), seeds its sampling once per manager, so a row's reply depends on what was scheduled beside it
and a resumed run draws other replies (bench/generate_rate.py, mode `hfcb`, times it beside refill.py).

Text is decoded as the OpenAI-compatible servers decode it (special tokens skipped), except that the
thinking markers `<think>` / `</think>` are kept where a tokenizer marks them special, so the reasoning
stays in the turn (DESIGN §10).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from dflash.errors import ConfigError
from dflash.generate.refill import static_width, supports_ring
from dflash.generate.rows import OVER_MAX_PROMPT
from dflash.target_model.capture import load_target, load_tokenizer, resolve_dtype

THINK_TAGS = ("<think>", "</think>")


@dataclass
class Request:
    key: int          # the row
    messages: list[dict]


@dataclass
class Response:
    key: int
    text: str | None
    tokens: int = 0
    cut: bool = False
    error: str | None = None  # a reason the row cannot be generated (it is left out and counted)


def devices(gpus: str, shards_wanted: int | None = None) -> list[str]:
    """One device per in-process worker: ['cpu'], or one CUDA device per listed GPU."""
    spec = (gpus or "auto").strip().lower()
    if spec not in ("cpu", "auto") and not torch.cuda.is_available():
        raise ConfigError(
            f"--gpus {gpus} asks for GPUs but CUDA is not available in this environment (torch "
            f"{torch.__version__}); generate on CPU with --gpus cpu, or leave --gpus at auto."
        )
    if spec == "cpu" or not torch.cuda.is_available():
        return ["cpu"]
    if spec == "auto":
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    try:
        ids = [int(g) for g in spec.split(",") if g.strip()]
    except ValueError:
        raise ConfigError(f"--gpus {gpus!r}: give GPU indices like 0,1,2, or cpu, or auto.") from None
    return [f"cuda:{i}" for i in ids]


def template_kwargs(thinking: str) -> dict:
    return {} if thinking == "template" else {"enable_thinking": thinking == "on"}


def check_thinking(tokenizer, thinking: str, where: str) -> None:
    """--thinking on/off must reach a template that reads the switch, or it would silently do nothing."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else str(tokenizer.chat_template)
    if thinking != "template" and "enable_thinking" not in (template or ""):
        raise ConfigError(
            f"--thinking {thinking}: the chat template of {where} has no `enable_thinking` switch, so the "
            "setting would change nothing; use --thinking template, or a target whose template has the switch."
        )


class LocalEngine:
    """The target on one device, generating batches of requests."""

    reports_batches = True  # generate(..., on_batch=) hands over each batch's responses as it finishes

    def __init__(self, cfg, device: str):
        self.cfg = cfg
        self.device = torch.device(device)
        self.tokenizer = load_tokenizer(cfg.target, cfg.trust_remote_code)
        check_thinking(self.tokenizer, cfg.thinking, f"target {cfg.target}")
        self.model = load_target(cfg.target, resolve_dtype(cfg.dtype, self.device), self.device,
                                 cfg.trust_remote_code)
        gen = self.model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.tokenizer.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos)
        self.max_positions = int(getattr(self.model.config, "max_position_embeddings", 0) or 0)
        self.think_ids = {self.tokenizer.convert_tokens_to_ids(t): t for t in THINK_TAGS
                          if t in self.tokenizer.get_vocab()}
        self.static = cfg.static_cache == "on" or (cfg.static_cache == "auto" and self.device.type == "cuda")
        # transformers 5.24 renamed generate's `past_key_values` to `cache`; the model's forward says which
        self.cache_kwarg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self._cache, self._cache_shape = None, None
        self.continuous = self._continuous(cfg.continuous_batching)
        if self.continuous:  # rows are refilled as they finish: long windows keep the rings full
            self.window_rows = max(cfg.batch_size, 1) * 64

    def _continuous(self, setting: str) -> bool:
        if setting == "off" or (setting == "auto" and self.device.type != "cuda"):
            return False
        why = supports_ring(self.model)
        if why is not None and setting == "on":
            raise ConfigError(
                f"--continuous-batching on: target {self.cfg.target} has {why}, which the ring-shaped cache of "
                "continuous batching does not model; use --continuous-batching off (or auto)."
            )
        if why is not None:  # auto on a GPU: say why the rows wait for their batch's longest
            print(f"generate: {self.device}: continuous batching off for this target ({why}); decoding in "
                  "batches.", flush=True)
        return why is None

    def encode(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  **template_kwargs(self.cfg.thinking))
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_length(self, messages: list[dict]) -> int:
        """The prompt's tokens: `dflash generate` orders its rows by it (drive.by_prompt_length)."""
        return len(self.encode(messages))

    def decode(self, ids: list[int]) -> str:
        """Special tokens skipped, as servers do, but thinking markers kept."""
        parts, run = [], []
        for t in ids:
            if t in self.think_ids:
                parts += [self.tokenizer.decode(run, skip_special_tokens=True), self.think_ids[t]]
                run = []
            else:
                run.append(t)
        parts.append(self.tokenizer.decode(run, skip_special_tokens=True))
        return "".join(parts)

    def _finish(self, key: int, ids: list[int]) -> Response:
        stop = next((j for j, t in enumerate(ids) if t in self.eos), None)
        body = ids if stop is None else ids[:stop]
        return Response(key, self.decode(body), tokens=len(ids) if stop is None else stop + 1, cut=stop is None)

    @torch.no_grad()
    def generate(self, requests: list[Request], seed: int = 0, on_batch=None) -> list[Response]:
        """Responses in the order of `requests`; batches of --batch-size prompts sorted by length.
        `on_batch(responses)` after each batch (first with the requests refused before any batch)."""
        encoded = {r.key: self.encode(r.messages) for r in requests}
        out: dict[int, Response] = {}
        ok = []
        cap = self.cfg.max_prompt_tokens
        for r in requests:
            n = len(encoded[r.key])
            if self.max_positions and n >= self.max_positions:
                out[r.key] = Response(r.key, None, error=f"prompt of {n} tokens reaches the target's "
                                      f"max_position_embeddings ({self.max_positions})")
            elif cap is not None and n > cap:
                out[r.key] = Response(r.key, None, error=f"{OVER_MAX_PROMPT} ({cap} tokens)")
            else:
                ok.append(r.key)
        if on_batch is not None and out:
            on_batch(list(out.values()))
        if self.continuous:
            from dflash.generate import refill

            def done(finished):
                got = [self._finish(key, ids) for key, ids in finished]
                out.update((r.key, r) for r in got)
                if on_batch is not None:
                    on_batch(got)

            refill.generate(self, {k: encoded[k] for k in ok}, seed, done)
            return [out[r.key] for r in requests]
        ok.sort(key=lambda k: (len(encoded[k]), k))
        b = 0
        while b < len(ok):
            keys = ok[b:b + max(1, self.cfg.batch_size)]
            # sorted by length, so dropping the longest rows can only narrow the batch: it still fits
            keys = keys[:self.rows_for(self.width_for(len(encoded[keys[-1]])))]
            b += len(keys)
            for key, ids in zip(keys, self._batch([encoded[k] for k in keys], seed + keys[0])):
                out[key] = self._finish(key, ids)
            if on_batch is not None:
                on_batch([out[k] for k in keys])
        return [out[r.key] for r in requests]

    def width_for(self, longest: int) -> int:
        """A batch's prompt width: its longest prompt, or with the static cache that padded (static_width)."""
        return static_width(longest, self.cfg.max_new_tokens, self.max_positions) if self.static else longest

    def new_tokens_for(self, width: int) -> int:
        """--max-new-tokens, held inside the target's context."""
        if self.max_positions:
            return max(1, min(self.cfg.max_new_tokens, self.max_positions - width))
        return self.cfg.max_new_tokens

    def rows_for(self, width: int) -> int:
        """Rows a batch of this width holds: --batch-size, fewer where rows x (width + new tokens) would pass
        --batch-tokens. The KV cache grows with that product, and the prefill's attention mask with it
        times the width (DESIGN §10); one count per width keeps the static cache's shapes few."""
        return max(1, min(self.cfg.batch_size, self.cfg.batch_tokens // (width + self.new_tokens_for(width))))

    def _static_cache(self, rows: int, length: int):
        """The static KV cache of a batch, reset and handed to every batch of the same rows and length.
        transformers would make a new one per `generate` call; its tensors' new addresses make the decode
        step's CUDA graphs record again (DESIGN §10), so one cache keeps them for a whole width. Only the
        current width's cache is held: the batches come sorted by length."""
        from transformers import StaticCache

        if self._cache_shape == (rows, length):
            self._cache.reset()
        else:
            self._cache = None  # freed before the next width's is allocated
            self._cache = StaticCache(config=self.model.config, max_cache_len=length)
            self._cache_shape = (rows, length)
        return self._cache

    def _batch(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        real = len(prompts)
        width = self.width_for(max(len(p) for p in prompts))
        if self.static:
            # transformers compiles the decode step per (rows, cache length): a few widths and one row
            # count a width keep the compilations few; the filler rows repeat the last prompt and are dropped.
            prompts = prompts + [prompts[-1]] * (self.rows_for(width) - real)
        input_ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            input_ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        new = self.new_tokens_for(width)
        sample = self.cfg.temperature > 0
        kw = dict(do_sample=True, temperature=self.cfg.temperature, top_p=self.cfg.top_p) if sample else \
            dict(do_sample=False, temperature=None, top_p=None, top_k=None)
        if sample:
            torch.manual_seed(seed)
        if self.static:
            kw[self.cache_kwarg] = self._static_cache(len(prompts), width + new)
        seqs = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                                   max_new_tokens=new, eos_token_id=sorted(self.eos), pad_token_id=self.pad, **kw)
        return [row[width:].tolist() for row in seqs[:real].cpu()]


STATIC_CACHE_ROWS = 1000  # ~100K tokens repay ~70 s of compiling at the real 135M target's rates, ~300 tokens a reply


def static_cache_note(static_cache: str, devices: list[str], rows: int, continuous: str = "off") -> str | None:
    """A hint where GPUs decode many rows through the dynamic cache: the static one's CUDA graphs
    decode a small target several times faster
    (benchmarks/generate-static-cache-smollm2-h100-2026-12-06.md). Continuous batching has graphs of its own."""
    if static_cache != "off" or continuous != "off" or devices == ["cpu"] or rows < STATIC_CACHE_ROWS:
        return None
    return (f"generate: {rows:,} rows on {', '.join(devices)} with --static-cache off; for a small target "
            "--static-cache on can decode several times faster (CUDA graphs: 7.4x for SmolLM2-135M at 64 rows a "
            "batch) after ~70 s of compiling.")


__all__ = ["Request", "Response", "LocalEngine", "devices", "static_cache_note", "static_width", "template_kwargs",
           "check_thinking"]
