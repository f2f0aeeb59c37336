"""Evaluation: speculative decoding is lossless, acceptance counting is right, `dflash eval` writes its files.

The lossless check holds for any drafter, good or useless: an untrained drafter (everything rejected),
a "cheating" one fed the target's own greedy tokens (everything accepted) and one that is right up to a
fixed position (every block cut mid-way, the hardest case for cache cropping) must all reproduce
target-only greedy decoding token for token.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import make_conversations_jsonl, make_tiny_target
from processes import invoke

B = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(target dir, target model, tokenizer, prompts): a random-init tiny Qwen3 on CPU in fp32."""
    from dflash.evaluate.run import load_prompts
    from dflash.target_model.capture import load_target, load_tokenizer

    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("eval")
    target_dir = make_tiny_target(tmp, num_layers=4)
    tok = load_tokenizer(target_dir)
    target = load_target(target_dir, torch.float32, torch.device("cpu"))
    chats = make_conversations_jsonl(tmp / "chats.jsonl", n=4, seed=3)
    prompts = load_prompts(chats, tok)
    return target_dir, target, tok, prompts, chats


def make_drafter(target, tok, num_layers=1, seed=0):
    from dflash.drafter import DFlashDrafter, DrafterConfig

    cfg = DrafterConfig.from_target(target.config, num_layers=num_layers, block_size=B,
                                    target_layer_ids=[1, 3], mask_token_id=len(tok))
    torch.manual_seed(seed)
    return DFlashDrafter(cfg).eval()


def save_run(run: Path, drafter, target_dir: Path, step: int = 1) -> Path:
    """A run directory holding one checkpoint of `drafter`, written by dflash.train.checkpoint itself."""
    from dflash.train.checkpoint import save_checkpoint

    return save_checkpoint(run, step, drafter.state_dict(), drafter.config.to_hf_dict(), {"step": step},
                           {"train": {"target": str(target_dir)}})


def oracle(reference: list[int], prompt_len: int, wrong_from: int | None = None):
    """A propose hook returning the target's own greedy continuation (wrong from block position
    `wrong_from` on, when given): the drafter every block of which the target accepts (up to there)."""

    def propose(start: int, proposals: torch.Tensor) -> torch.Tensor:
        i = start - prompt_len  # index of the anchor in the generated tokens
        nxt = reference[i + 1 : i + B]
        out = torch.tensor(nxt + [0] * (B - 1 - len(nxt)), dtype=torch.long)
        if wrong_from is not None:
            out[wrong_from - 1 :] = (out[wrong_from - 1 :] + 1) % 100  # a different, wrong token
        return out

    return propose


def test_greedy_reference_matches_transformers_generate(setup):
    from dflash.evaluate.speculative import greedy_generate

    _, target, tok, prompts, _ = setup
    ids = torch.tensor(prompts[0])
    ours = greedy_generate(target, ids, 24, eos_ids=set()).tokens
    theirs = target.generate(ids[None], max_new_tokens=24, min_new_tokens=24, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert ours == theirs


def test_untrained_drafter_is_lossless(setup):
    from dflash.evaluate.run import online_eval

    _, target, tok, prompts, _ = setup
    drafter = make_drafter(target, tok)
    r = online_eval(target, drafter, prompts, max_new_tokens=40, eos_ids=set(), progress=False)
    assert r["lossless"] is True and r["mismatches"] == []
    assert r["new_tokens"] == 40 * len(prompts)
    assert 1.0 <= r["tau"] <= B
    assert sum(r["tau_hist"]) == r["num_blocks"] > 0
    # one record per prompt, in order, whose step-weighted mean is the run's tau
    per = r["per_prompt"]
    assert [x["prompt_tokens"] for x in per] == [len(p) for p in prompts]
    assert [x["new_tokens"] for x in per] == [40] * len(prompts)
    assert sum(x["steps"] for x in per) == r["num_blocks"]
    assert sum(x["tau"] * x["steps"] for x in per) / r["num_blocks"] == pytest.approx(r["tau"])


def test_cheating_drafter_is_accepted_whole_and_lossless(setup):
    from dflash.evaluate.speculative import greedy_generate, speculative_generate

    _, target, tok, prompts, _ = setup
    drafter = make_drafter(target, tok)
    for p in prompts[:2]:
        ids = torch.tensor(p)
        ref = greedy_generate(target, ids, 60, eos_ids=set()).tokens
        got = speculative_generate(target, drafter, ids, 60, set(), propose=oracle(ref, len(p)))
        assert got.tokens == ref
        # every block but the last (which runs past max_new_tokens) accepts all B-1 proposals
        assert got.acceptance[:-1] == [B] * (len(got.acceptance) - 1)
        assert len(got.acceptance) == -(-(60 - 1) // B)


@pytest.mark.parametrize("wrong_from", [1, 3, B - 1])
def test_partial_acceptance_crops_caches_correctly(setup, wrong_from):
    """Proposals right up to position wrong_from - 1: every block accepts exactly that many, and the
    output (built over cropped target and draft caches) still equals target-only greedy decoding."""
    from dflash.evaluate.speculative import greedy_generate, speculative_generate

    _, target, tok, prompts, _ = setup
    drafter = make_drafter(target, tok)
    ids = torch.tensor(prompts[1])
    ref = greedy_generate(target, ids, 50, eos_ids=set()).tokens
    got = speculative_generate(target, drafter, ids, 50, set(), propose=oracle(ref, len(ids), wrong_from))
    assert got.tokens == ref
    assert set(got.acceptance[:-1]) == {wrong_from}


def test_eos_stops_both_loops_identically(setup):
    from dflash.evaluate.speculative import greedy_generate, speculative_generate

    _, target, tok, prompts, _ = setup
    drafter = make_drafter(target, tok)
    ids = torch.tensor(prompts[0])
    free = greedy_generate(target, ids, 40, eos_ids=set()).tokens
    eos = {free[17]}  # pretend a token the target emits is eos: both must stop right after it
    ref = greedy_generate(target, ids, 40, eos_ids=eos).tokens
    assert ref == free[: free.index(free[17]) + 1]
    for propose in (None, oracle(free, len(ids))):
        assert speculative_generate(target, drafter, ids, 40, eos, propose=propose).tokens == ref


def test_block_acceptance_counts_leading_correct_predictions():
    from dflash.train.heldout import summarize
    from dflash.train.loss import IGNORE, block_acceptance, block_stats

    b = 4
    labels = torch.tensor([[0, 5, 6, 7, 0, 5, 6, 7, 0, 5, IGNORE, 7, 0, IGNORE, IGNORE, IGNORE]])
    preds = torch.tensor([[9, 5, 6, 7, 9, 5, 1, 7, 9, 5, 6, 7, 9, 9, 9, 9]])
    tau, right, valid = block_acceptance(preds, labels, b)
    assert tau.tolist() == [4, 2, 2]  # all right; wrong at 2; an ignored label ends the run
    correct, valid_n, tau_sum, blocks = block_stats(preds, labels, b)
    assert int(tau_sum) == int(tau.sum()) and int(blocks) == len(tau)
    assert right.sum(0).tolist() == correct.tolist()
    s = summarize(tau.numpy(), b, right.sum(0).numpy(), valid.sum(0).numpy())
    assert s["tau"] == pytest.approx(8 / 3)
    assert s["tau_hist"] == [0, 2, 0, 1]
    assert s["acceptance"] == pytest.approx([1.0, 1 / 3, 1 / 3])


def test_offline_tau_on_a_store(tiny_store):
    from dflash.drafter import DFlashDrafter, DrafterConfig
    from dflash.evaluate.run import offline_tau
    from dflash.store import open_store
    from dflash.target_model.files import load_embed_and_head, target_config

    target_dir, _, store_dir = tiny_store
    store = open_store(store_dir)
    cfg = DrafterConfig.from_target(target_config(target_dir), num_layers=1, block_size=B,
                                    target_layer_ids=store.target_layer_ids,
                                    mask_token_id=target_config(target_dir).vocab_size - 1)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    embed, head = load_embed_and_head(target_dir)
    r1 = offline_tau(drafter, embed, head, store, num_anchors=8, progress=False)
    assert 1.0 <= r1["tau"] <= B
    assert r1["num_samples"] == len(store) and r1["num_blocks"] == sum(r1["tau_hist"]) > 0
    assert len(r1["acceptance"]) == B - 1 and len(r1["accuracy"]) == B - 1
    assert np.all(np.diff(r1["acceptance"]) <= 0)  # P(first k accepted) cannot grow with k
    r2 = offline_tau(drafter, embed, head, store, num_anchors=8, progress=False)
    assert r1 == r2  # anchors are drawn deterministically

    # A mismatched drafter (other layers) is refused with a message naming the layers.
    bad = DFlashDrafter(DrafterConfig.from_target(target_config(target_dir), 1, B, [0], 600))
    from dflash.errors import StoreError

    with pytest.raises(StoreError, match="target layers"):
        offline_tau(bad, embed, head, store, progress=False)


def test_dflash_eval_command_writes_json_tables_and_plots(setup, tiny_store, tmp_path):
    """End to end through the CLI: a checkpoint on disk, offline + online, files for dvc."""
    from dflash.drafter import DFlashDrafter, DrafterConfig
    from dflash.store import open_store
    from dflash.target_model.files import target_config

    target_dir, chats, store_dir = tiny_store
    store = open_store(store_dir)
    cfg = DrafterConfig.from_target(target_config(target_dir), num_layers=1, block_size=B,
                                    target_layer_ids=store.target_layer_ids,
                                    mask_token_id=target_config(target_dir).vocab_size - 1)
    torch.manual_seed(0)
    run = tmp_path / "run"
    save_run(run, DFlashDrafter(cfg), target_dir)
    out = tmp_path / "eval" / "eval.json"
    # in process (tests/evaluate/test_eval_workers.py runs the command as real processes)
    rc, stdout, stderr = invoke(["--run", run, "--store", store_dir, "--prompts", chats, "--max-samples", "3",
                                 "--max-new-tokens", "24", "--out", out], command="eval", cwd=tmp_path)
    assert rc == 0, stderr
    result = json.loads(out.read_text())
    # each tau printed under its own name: the top-level JSON tau is the offline one
    assert f"offline tau = {result['offline']['tau']:.3f} over 3 held-out samples" in stdout, stdout
    assert f"online tau = {result['online']['tau']:.3f} over 3 prompts" in stdout, stdout
    assert "lossless = True" in stdout
    assert result["lossless"] is True and 1.0 <= result["tau"] <= B
    assert result["offline"]["num_samples"] == 3 and result["online"]["num_prompts"] == 3
    assert (out.parent / "acceptance.csv").read_text().splitlines()[0] == "position,acceptance"
    assert len((out.parent / "tau_hist.csv").read_text().splitlines()) == B + 1
    for png in ("acceptance.png", "tau_hist.png"):
        assert (out.parent / png).read_bytes()[:4] == b"\x89PNG"

    # Default output: RUN/eval.json; a missing run is a one-paragraph error, not a traceback.
    rc, _, err = invoke(["--run", tmp_path / "nope", "--store", store_dir, "--no-plots"], command="eval", cwd=tmp_path)
    assert rc == 1 and "nope" in err, err


def test_drafting_in_the_loop_matches_the_training_forward(setup):
    """Every drafting step of the decoding loop (cached context, fed incrementally) gives the drafter
    output the training forward gives for that anchor over the whole sequence's target features."""
    from dflash.drafter import masks
    from dflash.evaluate.speculative import LayerCapture, speculative_generate

    _, target, tok, prompts, _ = setup
    drafter = make_drafter(target, tok, num_layers=2, seed=1)
    calls = []
    step = drafter.forward_step

    def spy(new_ctx, block_embeds, ctx_positions, block_positions, cache):
        h = step(new_ctx, block_embeds, ctx_positions=ctx_positions, block_positions=block_positions, cache=cache)
        calls.append((int(block_positions[0, 0]), block_embeds.clone(), h.clone()))
        return h

    drafter.forward_step = spy
    ids = prompts[2]
    ref = speculative_generate(target, drafter, torch.tensor(ids), 30, set())
    seq = torch.tensor(ids + ref.tokens)
    with LayerCapture(target, drafter.config.target_layer_ids) as cap, torch.no_grad():
        target(seq[None])
        feats = cap.features()[0]
    T, H = len(seq), drafter.config.hidden_size
    S, Q = 128 * -(-T // 128), 128
    assert len(calls) == len(ref.acceptance) > 3
    for a, emb, h in calls:
        ctx = torch.zeros(1, S, feats.shape[-1])
        ctx[0, :T] = feats
        blk = torch.zeros(1, Q, H)
        blk[0, :B] = emb[0]
        bpos = torch.zeros(1, Q, dtype=torch.long)
        bpos[0, :B] = torch.arange(a, a + B)
        mask = masks.to_dense_mask(masks.mask_metadata([0], [T], [0], [a], B, S, Q))
        with torch.no_grad():
            out = drafter(ctx, blk, torch.arange(S)[None], bpos, mask)
        torch.testing.assert_close(out[0, :B], h[0], atol=1e-4, rtol=1e-4)


def test_reference_file_is_written_once_reused_and_really_compared(setup, tmp_path):
    """--reference: the first eval writes the target-only outputs, the next reuses them (same result); the
    reused tokens are what speculative decoding is checked against (a doctored file shows a mismatch);
    other inputs (here --max-new-tokens) make it stale and it is rewritten."""
    from dflash.evaluate.reference import ReferenceFile
    from dflash.evaluate.run import online_eval
    from dflash.target_model.files import target_identity

    target_dir, target, tok, prompts, _ = setup
    drafter = make_drafter(target, tok)
    ident = target_identity(target_dir)
    path = tmp_path / "ref.json"
    ref = ReferenceFile(path, ident, prompts, 24, "fp32", "cpu")
    first = online_eval(target, drafter, prompts, max_new_tokens=24, eos_ids=set(), progress=False, reference=ref)
    assert first["reference"] == {"path": str(path), "reused": False} and path.is_file()
    again = online_eval(target, drafter, prompts, max_new_tokens=24, eos_ids=set(), progress=False,
                        reference=ReferenceFile(path, ident, prompts, 24, "fp32", "cpu"))
    assert again["reference"]["reused"] is True
    assert again["lossless"] and again["tau"] == first["tau"] and again["new_tokens"] == first["new_tokens"]
    doctored = json.loads(path.read_text())
    doctored["generations"][1]["tokens"][5] = (doctored["generations"][1]["tokens"][5] + 1) % len(tok)
    path.write_text(json.dumps(doctored))
    bad = online_eval(target, drafter, prompts, max_new_tokens=24, eos_ids=set(), progress=False,
                      reference=ReferenceFile(path, ident, prompts, 24, "fp32", "cpu"))
    assert not bad["lossless"] and [m["prompt"] for m in bad["mismatches"]] == [1]
    stale = ReferenceFile(path, ident, prompts, 16, "fp32", "cpu")
    assert stale.load() is None
    fresh = online_eval(target, drafter, prompts, max_new_tokens=16, eos_ids=set(), progress=False, reference=stale)
    assert fresh["reference"]["reused"] is False and fresh["lossless"] and stale.load() is not None
