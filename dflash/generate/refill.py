"""Continuous batching for the in-process engine: a fixed set of decode rows over a ring-shaped KV cache,
each finished row replaced by the next prompt at once, the decode step one CUDA graph (docs/DESIGN.md §10).

    ring   every row has its own `length` slots per layer; all rows write their next token's keys and values
           at the same slot (the step count modulo `length`), so one decode step is one fixed-shape forward.
           A row admitted at slot s has its prompt written to the slots just before s, and its span (prompt +
           new tokens) never exceeds `length`, so the ring never overwrites a live key of its own. Attention
           does not care where in a row a key sits: RoPE already holds each key's position, and a per-row
           additive mask (one graph input) says which slots are live.
    refill rows that hit EOS or their token budget free their slot; the queued prompts are prefilled (one
           forward, `logits_to_keep=1`) into the free slots once enough are free, instead of a batch waiting
           for its longest row.
    buckets  prompts go by padded width (`static_width`), each width with a ring of its own, so short
           prompts are not decoded over a long prompt's slots; when a width's queue is empty its live rows
           move into the lower half of the ring and a graph of half the rows carries on, so the tail of a
           width costs little.
    draws  a sampled token is drawn by inverse CDF with one uniform number per row and token, hashed from
           (--seed, the row, its prompt length, the token's index): a reply depends on its row alone, not on
           which rows shared its batch, so a resumed run draws what an uninterrupted one draws.

The model is called as transformers builds it, with a cache object of its own (`update` is all a decoder
layer asks of a cache) and a ready 4D mask (which transformers passes to the attention unchanged): targets
whose layers all attend over the whole context, with the sdpa or eager attention. Others use the batch
path (LocalEngine).
"""

from __future__ import annotations

import inspect
from collections import deque
from dataclasses import dataclass

import torch

PREFILL_TOKENS = 1 << 16  # rows x width of one prefill forward: its 4D mask grows with rows x width^2
MIN_GRAPH_ROWS = 8
MASK64 = (1 << 64) - 1


def static_width(width: int, max_new_tokens: int, max_positions: int, floor: int = 64) -> int:
    """The padded prompt width of a static-cache batch: the next power of two (at least `floor`), held
    below the target's context where that leaves room for --max-new-tokens, and never below `width`."""
    padded = max(floor, 1 << (width - 1).bit_length())
    if max_positions:
        padded = min(padded, max(width, max_positions - max_new_tokens))
    return padded


def supports_ring(model) -> str | None:
    """None when the target can decode through the ring, else why not (it then takes the batch path)."""
    cfg = model.config
    types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"}:
        return f"layer types {sorted(types)} (only layers that attend over the whole context)"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return f"a sliding window of {cfg.sliding_window}"
    if getattr(cfg, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        return f"attention {cfg._attn_implementation!r} (a ready 4D mask needs sdpa or eager)"
    return None


def mix64(*values: int) -> int:
    """splitmix64 over the values: the per-row salt of the draws."""
    x = 0x9E3779B97F4A7C15
    for v in values:
        x = (x ^ (v & MASK64)) * 0xBF58476D1CE4E5B9 & MASK64
        x = (x ^ (x >> 31)) * 0x94D049BB133111EB & MASK64
        x ^= x >> 29
    return x >> 1  # fits an int64 tensor


def uniforms(salt: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """One number in (0, 1) per row from its salt and token index (32-bit integer mixing, graph-safe)."""
    m = 0xFFFFFFFF
    x = ((salt & m) ^ (salt >> 32) ^ (count * 0x9E3779B1)) & m
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & m
    x = ((x ^ (x >> 15)) * 0x846CA68B) & m
    x = x ^ (x >> 16)
    return ((x >> 8).double() + 0.5) / float(1 << 24)


def pick(logits: torch.Tensor, salt: torch.Tensor, count: torch.Tensor, temperature: float, top_p: float):
    """The next token of each row: argmax at temperature 0, else an inverse-CDF draw from
    softmax(logits / T) (within the top-p nucleus) with the row's own uniform number."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    order = None
    if top_p < 1:
        probs, order = probs.sort(dim=-1, descending=True)
        # a token is kept while the mass before it is below top_p (the first always)
        probs = probs * ((probs.cumsum(-1) - probs) < top_p)
    cdf = probs.double().cumsum(-1)
    u = (uniforms(salt, count) * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[-1] - 1)
    return idx.squeeze(-1) if order is None else order.gather(-1, idx).squeeze(-1)


class RingCache:
    """Keys and values of `rows` rows x `length` slots per layer. The decode step writes one slot of the
    first `active` rows (`slot`, a device scalar the graph advances); a prefill writes the prompt slots of
    chosen rows (`prefill_at`)."""

    is_compileable = False

    def __init__(self, config, rows: int, length: int, dtype, device):
        kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (rows, kv, length, dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.length, self.active = length, rows
        # transformers' mask builders read one flag a layer (a list, never a bool: 5.18 tests `False in`)
        self.is_sliding = [False] * config.num_hidden_layers
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.prefill_at = None  # (rows [n], slots [W]) during a prefill

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.keys[layer_idx], self.values[layer_idx]
        if self.prefill_at is not None:
            rows, slots = self.prefill_at
            k[rows[:, None], :, slots[None, :]] = key_states.transpose(1, 2)
            v[rows[:, None], :, slots[None, :]] = value_states.transpose(1, 2)
            return key_states, value_states
        k, v = k[:self.active], v[:self.active]
        k.index_copy_(2, self.slot, key_states)
        v.index_copy_(2, self.slot, value_states)
        return k, v

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for t in self.keys + self.values:
            t.index_copy_(0, dst, t.index_select(0, src))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


@dataclass
class Item:
    key: int
    ids: list[int]
    budget: int   # new tokens at most
    salt: int


class Ring:
    """One width's ring: the cache, the decode step's inputs and outputs as fixed tensors, and on CUDA one
    graph per row count (rows, rows/2, ... down to MIN_GRAPH_ROWS)."""

    def __init__(self, engine, rows: int, width: int, length: int):
        self.eng, self.rows, self.width, self.length = engine, rows, width, length
        model, dev = engine.model, engine.device
        self.cache = RingCache(model.config, rows, length, model.dtype, dev)
        self.neg = torch.finfo(model.dtype).min
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(rows, 1, dtype=torch.long, device=dev)
        self.mask = torch.full((rows, 1, 1, length), self.neg, dtype=model.dtype, device=dev)
        self.zero = torch.zeros(rows, 1, dtype=model.dtype, device=dev)
        self.salt = torch.zeros(rows, dtype=torch.long, device=dev)
        self.count = torch.zeros(rows, dtype=torch.long, device=dev)  # the index of the token being drawn
        self.next = torch.zeros(rows, dtype=torch.long, device=dev)
        self.t = 0  # host copy of the write slot
        # the row counts a step runs at: all rows, then halves while a width's last rows finish
        smallest = MIN_GRAPH_ROWS if dev.type == "cuda" else 1
        self.sizes = [rows]
        while self.sizes[-1] % 2 == 0 and self.sizes[-1] // 2 >= smallest:
            self.sizes.append(self.sizes[-1] // 2)
        # transformers before 5.24 takes the write position as `cache_position`; the ring's own slot is it
        self.extra = {"cache_position": self.cache.slot} if "cache_position" in inspect.signature(
            model.forward).parameters else {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if dev.type == "cuda":
            self._capture()

    def _step(self, b: int) -> None:
        c = self.cache
        c.active = b
        # this step's slot is live in every row: a free row then attends to something finite too, never
        # to nothing (NaN keys in a free row would survive a refill masked, and 0 x NaN is NaN)
        self.mask[:b, 0, 0].index_copy_(1, c.slot, self.zero[:b])
        out = self.eng.model(input_ids=self.ids[:b], position_ids=self.pos[:b], attention_mask=self.mask[:b],
                             use_cache=True, **{self.eng.cache_kwarg: c}, **self.extra)
        self.next[:b] = pick(out.logits[:, -1], self.salt[:b], self.count[:b], self.eng.cfg.temperature,
                             self.eng.cfg.top_p)
        self.ids[:b, 0] = self.next[:b]
        self.pos[:b] += 1
        self.count[:b] += 1
        c.slot.add_(1).remainder_(self.length)

    def _capture(self) -> None:
        sizes, pool = self.sizes, None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for b in sizes:
                self._step(b)  # warm-up: no row is admitted yet, so nothing it writes is ever read
        torch.cuda.current_stream().wait_stream(side)
        for b in sizes:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self._step(b)
            pool = g.pool()
            self.graphs[b] = g
        self.cache.slot.zero_()
        self.pos.zero_()
        self.count.zero_()

    def step(self, b: int) -> list[int]:
        g = self.graphs.get(b)
        if g is not None:
            g.replay()
        else:  # CPU, or a row count without a graph
            self._step(b)
        self.t = (self.t + 1) % self.length
        return self.next[:b].tolist()

    def admit(self, slots: list[int], items: list[Item]) -> list[int]:
        """Prefill `items` into ring rows `slots`; returns each one's first token."""
        eng, dev, w = self.eng, self.eng.device, self.width
        n = len(items)
        lens = torch.tensor([len(it.ids) for it in items])
        ids = torch.full((n, w), eng.pad, dtype=torch.long)
        for i, it in enumerate(items):  # left padding: every prompt ends where its reply starts
            ids[i, w - len(it.ids):] = torch.tensor(it.ids)
        # built where it is used: a wide prompt's mask is rows x width^2
        q, start = torch.arange(w, device=dev), (w - lens).to(dev)
        real = q[None, :] >= start[:, None]  # [n, key]
        # causal over the prompt's own keys; a padding query sees itself rather than nothing
        allowed = ((q[None, :, None] >= q[None, None, :]) & real[:, None, :]) | torch.eye(w, dtype=torch.bool,
                                                                                         device=dev)
        pmask = torch.where(allowed, 0.0, self.neg).to(self.mask.dtype)[:, None]
        pos = (q[None, :] - start[:, None]).clamp_(min=0)
        rows = torch.tensor(slots, device=dev)
        ring = (torch.arange(w) + self.t - w) % self.length
        self.cache.prefill_at = (rows, ring.to(dev))
        try:
            out = eng.model(input_ids=ids.to(dev), position_ids=pos, attention_mask=pmask,
                            use_cache=True, logits_to_keep=1, **{eng.cache_kwarg: self.cache})
        finally:
            self.cache.prefill_at = None
        salt = torch.tensor([it.salt for it in items], device=dev)
        first = pick(out.logits[:, -1], salt, torch.zeros_like(salt), eng.cfg.temperature, eng.cfg.top_p)
        row_mask = torch.full((n, self.length), self.neg, dtype=self.mask.dtype)
        for i, it in enumerate(items):
            row_mask[i, ring[w - len(it.ids):]] = 0
        self.mask[rows, 0, 0] = row_mask.to(dev)
        self.ids[rows, 0] = first
        self.pos[rows, 0] = lens.to(dev)
        self.salt[rows] = salt
        self.count[rows] = 1
        return first.tolist()

    def move(self, src: list[int], dst: list[int]) -> None:
        s, d = torch.tensor(src, device=self.eng.device), torch.tensor(dst, device=self.eng.device)
        self.cache.move(s, d)
        for t in (self.ids, self.pos, self.mask, self.salt, self.count):
            t.index_copy_(0, d, t.index_select(0, s))


def decode_width(engine, ring: Ring, items: list[Item], on_done) -> None:
    """Every item through `ring`: rows refilled as they finish; `on_done([(key, tokens)])` as rows finish."""
    queue = deque(items)
    rows: list[Item | None] = [None] * ring.rows
    made: list[list[int]] = [[] for _ in range(ring.rows)]
    b = ring.rows
    while True:
        free = [i for i in range(b) if rows[i] is None]
        busy = b - len(free)
        if queue and free and (len(free) >= max(1, b // 16) or busy == 0):
            take = free[:len(queue)]
            chunk = max(1, PREFILL_TOKENS // ring.width)
            for c in range(0, len(take), chunk):
                slots = take[c:c + chunk]
                batch = [queue.popleft() for _ in slots]
                done = []
                for s, it, tok in zip(slots, batch, ring.admit(slots, batch)):
                    rows[s], made[s] = it, [tok]
                    if tok in engine.eos or it.budget <= 1:
                        done.append(s)
                finish(ring, rows, made, done, on_done)
            continue
        if busy == 0:
            return
        if not queue and b // 2 in ring.sizes and busy <= b // 2:
            b = compact(ring, rows, made, b)
        done = []
        for s, tok in enumerate(ring.step(b)):
            it = rows[s]
            if it is None:
                continue
            made[s].append(tok)
            if tok in engine.eos or len(made[s]) >= it.budget:
                done.append(s)
        finish(ring, rows, made, done, on_done)


def finish(ring: Ring, rows, made, done: list[int], on_done) -> None:
    if not done:
        return
    on_done([(rows[s].key, made[s]) for s in done])
    for s in done:
        rows[s], made[s] = None, []


def compact(ring: Ring, rows, made, b: int) -> int:
    """The live rows of [b/2, b) moved into the free rows of [0, b/2): the next steps run the half graph."""
    half = b // 2
    src = [s for s in range(half, b) if rows[s] is not None]
    dst = [s for s in range(half) if rows[s] is None][:len(src)]
    if src:
        ring.move(src, dst)
        for s, d in zip(src, dst):
            rows[d], made[d], rows[s], made[s] = rows[s], made[s], None, []
    return half


def generate(engine, prompts: dict[int, list[int]], seed: int, on_done) -> None:
    """Every prompt (key -> ids, shortest first) decoded by width: one ring a width, each freed before the
    next width's is allocated."""
    by_width: dict[int, list[Item]] = {}
    for key, ids in sorted(prompts.items(), key=lambda kv: (len(kv[1]), kv[0])):
        width = static_width(len(ids), engine.cfg.max_new_tokens, engine.max_positions)
        budget = engine.new_tokens_for(len(ids))
        by_width.setdefault(width, []).append(Item(key, ids, budget, mix64(seed, key, len(ids))))
    for width, items in sorted(by_width.items()):
        length = width + engine.new_tokens_for(width)
        rows = min(engine.rows_for(width), len(items))
        if engine.device.type == "cuda" and rows > MIN_GRAPH_ROWS:
            rows = -(-rows // MIN_GRAPH_ROWS) * MIN_GRAPH_ROWS  # halves stay whole down to the smallest graph
        ring = Ring(engine, rows, width, length)
        decode_width(engine, ring, items, on_done)
        del ring
