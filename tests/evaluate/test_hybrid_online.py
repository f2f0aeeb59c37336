"""Online speculative decoding stays lossless on every target family, hybrids included.

Qwen3.5 / Qwen3-Next mix full attention with linear-attention layers whose recurrent and convolution
states cannot be cropped; gpt-oss has sliding-window layers that forget keys once the window is full.
After a partly rejected block dflash.evaluate.target_cache must put every layer back exactly, so that
speculative decoding reproduces target-only greedy decoding token for token.  An untrained drafter
(nearly every block rejected after the anchor) and oracle drafters right up to a fixed block position
(every block cut there) are run on tiny random-init checkpoints of each family.
"""

from __future__ import annotations

import pytest
import torch

from dflash.errors import TargetError
from target_families import FAMILIES, HYBRID, make_family_target

B = 8
N = 40  # new tokens: prompt (~20) + N runs well past gpt-oss's sliding window of 8


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request, tmp_path_factory):
    from dflash.evaluate.run import load_prompts
    from dflash.target_model.capture import load_target, load_tokenizer
    from helpers import make_conversations_jsonl

    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp(request.param)
    d = make_family_target(tmp, request.param, num_layers=4)
    tok = load_tokenizer(d)
    target = load_target(d, torch.float32, torch.device("cpu"))
    prompts = load_prompts(make_conversations_jsonl(tmp / "chats.jsonl", n=2, seed=5, max_words=8), tok)
    return request.param, target, tok, prompts


def make_drafter(target, tok, seed=0):
    from dflash.drafter import DFlashDrafter, DrafterConfig

    cfg = DrafterConfig.from_target(target.config, num_layers=1, block_size=B, target_layer_ids=[1, 3],
                                    mask_token_id=len(tok))
    torch.manual_seed(seed)
    return DFlashDrafter(cfg).eval()


def oracle(reference: list[int], prompt_len: int, wrong_from: int | None = None):
    """The target's own greedy continuation as proposals, wrong from block position `wrong_from` on."""

    def propose(start: int, proposals: torch.Tensor) -> torch.Tensor:
        i = start - prompt_len
        out = torch.tensor(reference[i + 1 : i + B] + [0] * max(0, B - 1 - len(reference[i + 1 : i + B])))
        if wrong_from is not None:
            out[wrong_from - 1 :] = (out[wrong_from - 1 :] + 1) % 100
        return out

    return propose


def test_untrained_drafter_is_lossless(setup):
    from dflash.evaluate.run import online_eval

    _, target, tok, prompts = setup
    r = online_eval(target, make_drafter(target, tok), prompts, max_new_tokens=N, eos_ids=set(), progress=False)
    assert r["lossless"] is True and r["mismatches"] == []
    assert r["new_tokens"] == N * len(prompts)
    assert r["num_blocks"] > 0 and r["tau"] < B  # blocks were (partly) rejected


@pytest.mark.parametrize("wrong_from", [1, 3, B - 1, None])
def test_partly_rejected_blocks_roll_back_exactly(setup, wrong_from):
    from dflash.evaluate.speculative import greedy_generate, speculative_generate

    _, target, tok, prompts = setup
    drafter = make_drafter(target, tok)
    ids = torch.tensor(prompts[0])
    assert len(ids) + N > 8  # past the sliding window of the gpt-oss target
    ref = greedy_generate(target, ids, N, eos_ids=set()).tokens
    got = speculative_generate(target, drafter, ids, N, set(), propose=oracle(ref, len(ids), wrong_from))
    assert got.tokens == ref
    assert set(got.acceptance[:-1]) == {wrong_from or B}  # every block cut exactly there (or accepted whole)


def _prefix_state(target, ids):
    """Linear-attention states of a fresh cache after running `ids` token by token (greedy's path)."""
    from dflash.evaluate.speculative import _cache_kw
    from dflash.evaluate.target_cache import TargetCache

    tc = TargetCache(target)
    target(input_ids=ids[:, :-1], **{_cache_kw(target): tc.cache}, use_cache=True)
    target(input_ids=ids[:, -1:], **{_cache_kw(target): tc.cache}, use_cache=True)
    return tc


@pytest.mark.parametrize("kept", [1, 5])
def test_linear_states_after_rollback_equal_a_fresh_prefix(setup, kept):
    """The states themselves (not only the tokens): snapshot, a block of B, rollback + re-run of `kept`
    tokens == a cache that only ever saw prompt + those tokens.  Without the restore they differ."""
    from dflash.evaluate.speculative import _cache_kw
    from dflash.evaluate.target_cache import TargetCache

    name, target, _, prompts = setup
    if name not in HYBRID:
        pytest.skip("no linear-attention layers")
    ids = torch.tensor(prompts[0]).view(1, -1)
    block = torch.randint(0, 500, (1, B), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        tc = TargetCache(target)
        target(input_ids=ids, **{_cache_kw(target): tc.cache}, use_cache=True)
        tc.before_block()
        target(input_ids=block, **{_cache_kw(target): tc.cache}, use_cache=True)
        dirty = [layer.recurrent_states[0].clone() for layer in tc.linear]
        assert tc.keep(ids.shape[1], B, kept) is True
        # the positions the re-run gets: from 5.25 the cache's length may be a linear layer's own count
        assert int(tc.cache.get_seq_length()) == ids.shape[1]
        target(input_ids=block[:, :kept], **{_cache_kw(target): tc.cache}, use_cache=True)
        fresh = _prefix_state(target, torch.cat([ids, block[:, :kept]], dim=1))
    assert tc.cache.get_seq_length() == fresh.cache.get_seq_length() == ids.shape[1] + kept
    for a, b, d in zip(tc.linear, fresh.linear, dirty):
        torch.testing.assert_close(a.recurrent_states[0], b.recurrent_states[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(a.conv_states[0], b.conv_states[0], rtol=1e-4, atol=1e-5)
        assert not torch.allclose(d, b.recurrent_states[0], atol=1e-4)  # the test can tell a missing restore


def test_a_cache_that_cannot_be_rolled_back_is_refused(setup, monkeypatch):
    """An unknown cache layer type gets a one-paragraph TargetError before decoding, not a traceback."""
    import transformers.cache_utils as cu

    from dflash.evaluate.speculative import speculative_generate

    name, target, tok, prompts = setup
    if name != "qwen3":
        pytest.skip("one family is enough")

    class OddLayer(cu.DynamicLayer):
        pass

    monkeypatch.setitem(cu.DYNAMIC_LAYER_TYPE_MAPPING, "full_attention", OddLayer)
    with pytest.raises(TargetError, match=r"cannot roll back.*OddLayer|OddLayer.*cannot roll back") as e:
        speculative_generate(target, make_drafter(target, tok), torch.tensor(prompts[0]), 8, set())
    assert "\n" not in str(e.value)


def test_a_prompt_prefilled_in_pieces_decodes_the_same(setup, monkeypatch):
    """The eval's prefill runs a long prompt a few tokens a forward (memory: fp32 attention scores grow
    with the square of a whole prompt); each family's cache then continues from the pieces, target-only and
    speculative alike, and gives the tokens of a prompt run whole."""
    import dflash.evaluate.speculative as S

    _, target, tok, prompts = setup
    ids = torch.tensor(prompts[0])
    whole = S.greedy_generate(target, ids, N, eos_ids=set()).tokens
    widths: list[int] = []
    hook = target.register_forward_pre_hook(lambda _m, _a, kw: widths.append(kw["input_ids"].shape[1]),
                                            with_kwargs=True)
    monkeypatch.setattr(S, "PREFILL_CHUNK", 5)
    try:
        pieces = S.greedy_generate(target, ids, N, eos_ids=set()).tokens
        first = widths[: -(N - 1)]  # the prefill's forwards, before the N - 1 of one token each
        got = S.speculative_generate(target, make_drafter(target, tok), ids, N, set())
    finally:
        hook.remove()
    assert first == [5] * (len(ids) // 5) + ([len(ids) % 5] if len(ids) % 5 else [])
    assert pieces == whole
    assert got.tokens == whole
