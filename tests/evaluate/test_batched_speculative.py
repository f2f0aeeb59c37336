"""Speculative decoding of many prompts in one batch (dflash.evaluate.batched_speculative) gives, row by
row, what decoding each prompt alone gives: the drafter's proposals at every step, the accepted lengths and
the tokens, with rows of different prompt lengths whose blocks are cut at different positions (rejected
drafts left in the target's cache, masked) and that finish at different steps (leaving the batch)."""

from __future__ import annotations

import pytest
import torch

from helpers import make_conversations_jsonl, make_tiny_target

B = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from dflash.drafter import DFlashDrafter, DrafterConfig
    from dflash.evaluate.run import load_prompts
    from dflash.evaluate.speculative import greedy_generate
    from dflash.target_model.capture import load_target, load_tokenizer

    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("batched")
    target_dir = make_tiny_target(tmp, num_layers=4)
    tok = load_tokenizer(target_dir)
    target = load_target(target_dir, torch.float32, torch.device("cpu"))
    prompts = load_prompts(make_conversations_jsonl(tmp / "c.jsonl", n=5, seed=5), tok)
    cfg = DrafterConfig.from_target(target.config, num_layers=2, block_size=B, target_layer_ids=[1, 3],
                                    mask_token_id=len(tok))
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).eval()
    refs = [greedy_generate(target, torch.tensor(p), 30, set()).tokens for p in prompts]
    return target, drafter, prompts, refs


def test_each_row_decodes_as_its_prompt_alone(setup):
    from dflash.evaluate.batched_speculative import speculative_rows
    from dflash.evaluate.speculative import speculative_generate

    target, drafter, prompts, refs = setup
    assert len({len(p) for p in prompts}) == len(prompts)
    wrong_from = [None, 3, 5, 2, 7]  # the oracle is right up to this block position (None: whole blocks)
    eos = {refs[2][17]}  # row 2 stops early, the others at 30 tokens or at their own eos
    seen: dict[str, dict] = {"alone": {}, "batched": {}}

    def oracle(k: int, how: str):
        P = len(prompts[k])

        def propose(start: int, proposals: torch.Tensor) -> torch.Tensor:
            seen[how][(k, start)] = proposals.tolist()  # the drafter's own guesses, before the oracle's
            nxt = refs[k][start - P + 1 : start - P + B]
            out = torch.tensor(nxt + [0] * (B - 1 - len(nxt)))
            if wrong_from[k] is not None:
                out[wrong_from[k] - 1 :] = (out[wrong_from[k] - 1 :] + 1) % 100
            return out

        return propose

    alone = [speculative_generate(target, drafter, torch.tensor(p), 30, eos, propose=oracle(k, "alone"))
             for k, p in enumerate(prompts)]
    rows = speculative_rows(target, drafter, prompts, 30, eos,
                            propose=lambda r, start, p: oracle(r, "batched")(start, p))
    assert [g.tokens for g in rows] == [g.tokens for g in alone]
    assert [g.acceptance for g in rows] == [g.acceptance for g in alone]
    assert seen["batched"].keys() == seen["alone"].keys()
    for key, got in seen["batched"].items():
        assert got == seen["alone"][key], key
    assert {a for g in alone for a in g.acceptance} >= {2, 3, 5, B}  # blocks cut at different positions
    assert len({len(g.acceptance) for g in alone}) > 1  # rows leave the batch at different steps
    assert all(g.seconds is None for g in rows)


def test_untrained_drafter_rows_are_lossless(setup):
    from dflash.evaluate.batched_speculative import speculative_rows

    target, drafter, prompts, refs = setup
    rows = speculative_rows(target, drafter, prompts, 30, set())
    assert [g.tokens for g in rows] == refs
    assert all(sum(g.acceptance) == len(g.tokens) - 1 for g in rows)  # the prefill's token, then the steps'


def test_prefill_in_pieces_gives_the_features_and_tokens_of_a_whole_prompt(setup, monkeypatch):
    """Left-padded rows prefilled a few tokens a forward: the same context features and next tokens as one
    forward over the whole width, and batched decodes that still give every row's reference."""
    from transformers import DynamicCache

    import dflash.evaluate.speculative as S
    from dflash.evaluate.batched_speculative import speculative_rows
    from dflash.evaluate.prompt_sets import reference_decode

    target, drafter, prompts, refs = setup
    n, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):], mask[r, width - len(p):] = torch.tensor(p), 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)

    def run(chunk):
        with torch.inference_mode(), S.LayerCapture(target, drafter.config.target_layer_ids) as cap:
            kw = {S._cache_kw(target): DynamicCache(config=target.config), "use_cache": True}
            out, feats = S.prefill(target, ids, kw, mask=mask, positions=positions, capture=cap, chunk=chunk)
            return out.logits[:, -1], feats

    whole_logits, whole_feats = run(width)
    logits, feats = run(3)
    real = mask.bool()  # padded positions attend to nothing and hold no feature anyone reads
    assert feats.shape == whole_feats.shape == (n, width, whole_feats.shape[-1])
    torch.testing.assert_close(feats[real], whole_feats[real], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits, whole_logits, rtol=1e-4, atol=1e-5)
    monkeypatch.setattr(S, "PREFILL_CHUNK", 3)
    assert [g.tokens for g in speculative_rows(target, drafter, prompts, 30, set())] == refs
    assert [g.tokens for g in reference_decode(target, prompts, max_new_tokens=30, eos_ids=set(),
                                               batch_size=8)] == refs


def test_the_timed_prompts_are_the_middles_of_each_sets_tau_ranking():
    from dflash.evaluate.prompt_sets import tau_strata

    taus = [8.0, 1.0, 7.0, 2.0, 6.0, 3.0, 5.0, 4.0]
    assert tau_strata(taus, 2) == [2, 5]  # ranked 1..8: the middles of {1..4} and {5..8} are 3 and 7
    assert tau_strata(taus, 4) == [0, 3, 4, 7]  # taus 2, 4, 6, 8
    assert tau_strata(taus, 8) == tau_strata(taus, 20) == list(range(8))
    assert len(tau_strata([2.0] * 5, 2)) == 2  # ties: still as many prompts as asked


def test_decode_batched_times_each_groups_tau_strata_alone(setup):
    from dflash.evaluate.batched_speculative import speculative_rows
    from dflash.evaluate.online import decode_prompts
    from dflash.evaluate.prompt_sets import decode_batched, tau_strata
    from dflash.evaluate.speculative import Generation

    target, drafter, prompts, refs = setup
    gens = [Generation(tokens=r, seconds=None) for r in refs]
    asked: list[list[int]] = []

    def single(some, some_refs):
        asked.append([prompts.index(p) for p in some])
        assert some_refs == [None] * len(some)  # the batch's outputs are untimed: target-only again, timed
        return decode_prompts(target, drafter, some, some_refs, max_new_tokens=30, eos_ids=set())

    groups = [[0, 1, 2], [3, 4]]
    records = decode_batched(target, drafter, prompts, gens, single, max_new_tokens=30, eos_ids=set(), batch_size=4,
                             timed=1, groups=groups)
    batched = speculative_rows(target, drafter, prompts, 30, set())
    want = [g[k] for g in groups for k in tau_strata([sum(batched[i].acceptance) / len(batched[i].acceptance)
                                                      for i in g], 1)]
    assert asked == [want]
    timed = [i for i, r in enumerate(records) if r["ref"]["seconds"] is not None]
    assert timed == want and all(records[i]["got"]["seconds"] is not None for i in timed)
    assert all(r["got"]["tokens"] == refs[i] for i, r in enumerate(records))  # lossless, batched and alone
