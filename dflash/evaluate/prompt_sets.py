"""Online eval on standard prompt sets (`dflash eval --bench`), and the target-only reference decoded in
batches.

The target-only greedy outputs are what speculative decoding must reproduce, and a multi-turn question's
later turns are asked after them (the target's own answer: greedy decoding is deterministic, and the
speculative decode of a turn is, losslessly, that same answer).  Decoding them one prompt at a time costs
one target forward per token; `reference_decode` decodes many prompts per forward (left-padded, each row
at its own positions), and `decode_batched` the speculative side likewise (batched_speculative.py).  A
batch's time is not one prompt's, so the speed-up comes from a few prompts of each set (`timed`) decoded
again alone both ways, whose target-only outputs also check the batch's.  They are picked after the batches,
one from each of `timed` equal slices of the set ranked by the prompts' tau (its middle), so that their tau
spans the set's as the whole set does: a speed-up follows tau, and prompts merely spread over the file can
sit far from the set's tau (docs/DESIGN.md §6).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from dflash.errors import DFlashError
from dflash.evaluate.batched_speculative import has_linear_attention, speculative_rows
from dflash.evaluate.bench import BenchItem
from dflash.evaluate.online import summarize_online
from dflash.evaluate.speculative import Generation, _cache_kw, _finish, greedy_generate, prefill

# decode(prompts, refs, groups) -> one record per prompt (dflash.evaluate.online.decode_prompts); a None ref is
# decoded target-only there, one prompt at a time, and timed; `groups`: the prompt sets' indices, each timing
# its own prompts (None: one set)
Decode = Callable[[list[list[int]], list, list[list[int]] | None], list[dict]]
Single = Callable[[list[list[int]], list], list[dict]]  # decode_prompts over some prompts, one at a time


@torch.inference_mode()
def _greedy_rows(target, prompts: list[list[int]], max_new_tokens: int, eos_ids: set[int]) -> list[list[int]]:
    from transformers import DynamicCache

    device = next(target.parameters()).device
    n, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros((n, width), dtype=torch.long, device=device)
    mask = torch.zeros((n, width), dtype=torch.long, device=device)
    for r, p in enumerate(prompts):  # left-padded: every row's next token is the last column
        ids[r, width - len(p):] = torch.tensor(p, device=device)
        mask[r, width - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=target.config)
    kw = {_cache_kw(target): cache, "use_cache": True}
    out, _ = prefill(target, ids, kw, mask=mask, positions=positions)
    nxt = positions[:, -1:] + 1
    tokens: list[list[int]] = [[] for _ in prompts]
    done = [False] * n
    while True:
        tok = out.logits[:, -1].argmax(-1)
        for r, t in enumerate(tok.tolist()):
            if not done[r]:
                tokens[r], done[r] = _finish(tokens[r] + [t], max_new_tokens, eos_ids)
        if all(done):
            return tokens
        mask = torch.cat([mask, mask.new_ones((n, 1))], dim=1)
        out = target(input_ids=tok.view(n, 1), attention_mask=mask, position_ids=nxt, **kw)
        nxt = nxt + 1


ROW_TOKENS = 512  # a batch holds batch_size rows of this many padded prompt tokens at most (long prompts: fewer rows)


def batches(order: list[int], lengths: list[int], batch_size: int) -> list[list[int]]:
    """`order` (sorted by length) cut into batches of at most `batch_size` rows and batch_size * ROW_TOKENS
    padded prompt tokens: a few long prompts do not pad a whole batch to their length."""
    out: list[list[int]] = []
    for i in order:
        cur = out[-1] if out else None
        if cur and len(cur) < batch_size and (len(cur) + 1) * max(lengths[j] for j in cur + [i]) <= batch_size * ROW_TOKENS:
            cur.append(i)
        else:
            out.append([i])
    return out


def reference_decode(target, prompts: list[list[int]], *, max_new_tokens: int, eos_ids: set[int],
                     batch_size: int, progress=None) -> list[Generation]:
    """Every prompt's target-only greedy output: `batch_size` prompts of similar length per forward
    (seconds None: not a single-stream time), or one at a time and timed with batch_size 1 (and for a
    target with linear-attention layers, whose padded rows transformers does not keep apart)."""
    if batch_size <= 1 or has_linear_attention(target):
        device = next(target.parameters()).device
        as_ids = [torch.tensor(p, dtype=torch.long, device=device) for p in prompts]
        if as_ids:  # warm-up, out of the timing
            greedy_generate(target, as_ids[0], min(8, max_new_tokens), eos_ids)
        out = []
        for ids in as_ids:
            out.append(greedy_generate(target, ids, max_new_tokens, eos_ids))
            if progress is not None:
                progress(1)
        return out
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    gens: list = [None] * len(prompts)
    for rows in batches(order, [len(p) for p in prompts], batch_size):
        for i, toks in zip(rows, _greedy_rows(target, [prompts[i] for i in rows], max_new_tokens, eos_ids)):
            gens[i] = Generation(tokens=toks, seconds=None)
        if progress is not None:
            progress(len(rows))
    return gens


def timed_indices(n: int, timed: int) -> list[int]:
    """`timed` indices spread evenly over range(n) (all of them when timed >= n)."""
    if timed >= n:
        return list(range(n))
    return sorted({int(round(x)) for x in np.linspace(0, n - 1, max(timed, 1))})


def spread_timed(refs: list[Generation], timed: int, groups: list[list[int]] | None = None) -> list:
    """The refs to decode against where nothing is batched (--workers): in each group `timed` prompts spread
    over it decoded alone target-only, timing the target and checking the batch's output (None; a timed ref,
    as a reused reference may hold, is kept instead), the rest against the refs' outputs, untimed."""
    out: list = [Generation(tokens=g.tokens, seconds=None) for g in refs]
    for group in groups if groups is not None else [list(range(len(refs)))]:
        for k in timed_indices(len(group), timed):
            i = group[k]
            out[i] = refs[i] if refs[i].seconds is not None else None
    return out


def tau_strata(taus: list[float], timed: int) -> list[int]:
    """`timed` of the positions of `taus`: rank them by tau, cut the ranking into `timed` equal slices and take
    each slice's middle (all of them when timed >= len(taus)); ties keep their order."""
    n = len(taus)
    if timed >= n:
        return list(range(n))
    ranked = sorted(range(n), key=lambda i: taus[i])
    return sorted({ranked[int((j + 0.5) * n / max(timed, 1))] for j in range(max(timed, 1))})


def batch_disagreements(records: list[dict], refs: list[Generation]) -> list[int]:
    """Prompts decoded again alone whose single-stream target-only output differs from the batch's (near-ties
    only, in fp32)."""
    return [i for i, (r, g) in enumerate(zip(records, refs))
            if g is not None and g.seconds is None and r["ref"]["seconds"] is not None and r["ref"]["tokens"] != g.tokens]


def _record(target, prompt: list[int], ref: Generation, got: Generation, i: int) -> dict:
    """One prompt's record, as dflash.evaluate.online.decode_prompts writes it."""
    from dflash.evaluate.online import _margin

    rec = {"prompt_tokens": len(prompt), "ref": {"tokens": ref.tokens, "seconds": ref.seconds},
           "got": {"tokens": got.tokens, "seconds": got.seconds, "acceptance": got.acceptance}}
    if got.tokens != ref.tokens:
        at = next((j for j, (a, b) in enumerate(zip(got.tokens, ref.tokens)) if a != b),
                  min(len(got.tokens), len(ref.tokens)))
        ids = torch.tensor(prompt, dtype=torch.long, device=next(target.parameters()).device)
        rec["mismatch"] = {"prompt": i, "first_difference": at, "target_only": ref.tokens[at : at + 8],
                           "speculative": got.tokens[at : at + 8],
                           "logit_margin": _margin(target, ids, ref.tokens, got.tokens, at)}
    return rec


def decode_batched(target, drafter, prompts: list[list[int]], refs: list[Generation], single: Single, *,
                   max_new_tokens: int, eos_ids: set[int], batch_size: int, timed: int,
                   groups: list[list[int]] | None = None, progress=None) -> list[dict]:
    """Every prompt's record: all of them speculatively in batches of `batch_size` rows of similar lengths
    (untimed), then in each of `groups` the `timed` prompts at the middles of its tau's slices (tau_strata)
    decoded again alone and timed both ways (`single`: target-only again unless `refs` holds a timed output,
    as a reused reference may), their records replacing the batch's."""
    untimed = [Generation(tokens=g.tokens, seconds=None) for g in refs]
    records: list = [None] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), len(refs[i].tokens)))
    for part in batches(order, [len(p) for p in prompts], batch_size):
        got = speculative_rows(target, drafter, [prompts[i] for i in part], max_new_tokens, eos_ids)
        for i, g in zip(part, got):
            records[i] = _record(target, prompts[i], untimed[i], g, i)
        if progress is not None:
            progress(len(part))
    chosen = []
    for group in groups if groups is not None else [list(range(len(prompts)))]:
        taus = [float(np.mean(records[i]["got"]["acceptance"] or [0])) for i in group]
        chosen += [group[k] for k in tau_strata(taus, timed)]
    alone = single([prompts[i] for i in chosen], [refs[i] if refs[i].seconds is not None else None
                                                  for i in chosen]) if chosen else []
    for i, rec in zip(chosen, alone):
        if "mismatch" in rec:
            rec["mismatch"]["prompt"] = i
        records[i] = rec
    return records


def _chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


def bench_prompts(target, tokenizer, sets: dict[str, list[BenchItem]], *, max_new_tokens: int, eos_ids: set[int],
                  batch_size: int, budget: int | None, progress=None,
                  stored: list[Generation] | None = None) -> tuple[list[list[int]], list[Generation], list[dict]]:
    """Every turn of every question as a prompt, with its target-only reference and what it is: turn t+1's
    prompt holds turn t's question and the target's greedy answer to it (decoded text, as the field's
    multi-turn benchmarks replay it).  A prompt longer than `budget` is left out with its later turns.
    `stored`: the references of an earlier eval of the same target and questions (dflash.evaluate.reference),
    in the order this decodes them, taken instead of decoding."""
    convs = [(name, item, []) for name, items in sets.items() for item in items]
    prompts, refs, meta = [], [], []
    for turn in range(max((len(item.turns) for _, item, _ in convs), default=0)):
        live, ids = [], []
        for k, (name, item, msgs) in enumerate(convs):
            if turn >= len(item.turns) or msgs is None:
                continue
            msgs.append({"role": "user", "content": item.turns[turn]})
            p = _chat_ids(tokenizer, msgs)
            if budget is not None and len(p) > budget:
                convs[k] = (name, item, None)
                meta.append({"set": name, "id": item.id, "category": item.category, "turn": turn + 1,
                             "left_out_tokens": len(p)})
                continue
            live.append(k)
            ids.append(p)
        if stored is not None:
            gens = stored[len(refs):len(refs) + len(ids)]
            if len(gens) != len(ids):
                raise DFlashError("the --bench reference file holds fewer target-only outputs than its questions' "
                                  "turns; delete it (the next eval rewrites it).")
            if progress is not None:
                progress(len(ids))
        else:
            gens = reference_decode(target, ids, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                                    batch_size=batch_size, progress=progress)
        for k, p, g in zip(live, ids, gens):
            name, item, msgs = convs[k]
            msgs.append({"role": "assistant",
                         "content": tokenizer.decode(g.tokens, skip_special_tokens=True).strip()})
            prompts.append(p)
            refs.append(g)
            meta.append({"set": name, "id": item.id, "category": item.category, "turn": turn + 1,
                         "index": len(prompts) - 1})
    return prompts, refs, meta


def _brief(s: dict, base_tps: float | None) -> dict:
    """A group's numbers: tau, lossless, tokens, and the speed-up against its set's target-only speed."""
    spec = s["tokens_per_s_speculative"] or None  # None: no prompt of the group decoded alone
    return {"tau": s["tau"], "lossless": s["lossless"], "num_prompts": s["num_prompts"],
            "new_tokens": s["new_tokens"], "tokens_per_s_speculative": spec,
            "speedup": spec / base_tps if base_tps and spec else None}


def summarize_sets(records: list[dict], meta: list[dict], block_size: int, disagree: list[int]) -> dict:
    """Per prompt set: the summary of all its prompts (dflash.evaluate.online.summarize_online) plus the
    same numbers per category and per turn.  `records` are in the order of the prompts in `meta`."""
    out = {}
    for name in dict.fromkeys(m["set"] for m in meta):
        rows = [m for m in meta if m["set"] == name and "index" in m]
        recs = [records[m["index"]] for m in rows]
        s = summarize_online(recs, block_size, None)
        by_index = {m["index"]: m for m in rows}
        for mm in s["mismatches"]:  # "prompt": the index among every set's prompts, as decoded
            m = by_index[mm["prompt"]]
            mm.update(question=m["id"], category=m["category"], turn=m["turn"])
        for pp, m in zip(s["per_prompt"], rows):
            pp.update(question=m["id"], category=m["category"], turn=m["turn"])
        base = s["tokens_per_s_target"]
        groups = {}
        for key, field in (("categories", "category"), ("turns", "turn")):
            groups[key] = {}
            for value in dict.fromkeys(m[field] for m in rows):
                sub = [r for r, m in zip(recs, rows) if m[field] == value]
                groups[key][str(value)] = _brief(summarize_online(sub, block_size, None), base)
        s.update(groups)
        s["prompts_left_out"] = [{k: m[k] for k in ("id", "turn", "left_out_tokens")}
                                 for m in meta if m["set"] == name and "index" not in m]
        s["timed_prompts"] = sum(r["ref"]["seconds"] is not None for r in recs)
        s["batched_reference_differs"] = [m["index"] for m in rows if m["index"] in disagree]
        out[name] = s
    return out


def run_benches(target, tokenizer, sets: dict[str, list[BenchItem]], decode: Decode, *, block_size: int,
                max_new_tokens: int, eos_ids: set[int], batch_size: int, budget: int | None,
                progress=None, reference=None) -> dict:
    """Every prompt set decoded speculatively against its target-only reference, summed up per set.
    `reference` (a ReferenceFile keyed by the questions) keeps the target-only outputs across evals."""
    stored = reference.load() if reference is not None else None
    prompts, refs, meta = bench_prompts(target, tokenizer, sets, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                                        batch_size=batch_size, budget=budget, progress=progress, stored=stored)
    if reference is not None and stored is None:
        reference.save(refs)
    groups = [[m["index"] for m in meta if m["set"] == name and "index" in m] for name in sets]
    records = decode(prompts, refs, groups) if prompts else []  # each set times its own prompts
    out = summarize_sets(records, meta, block_size, batch_disagreements(records, refs))
    for s in out.values():
        s["reference"] = None if reference is None else {"path": str(reference.path), "reused": stored is not None}
    return out


__all__ = ["bench_prompts", "decode_batched", "reference_decode", "run_benches", "spread_timed", "summarize_sets",
           "tau_strata", "timed_indices"]
