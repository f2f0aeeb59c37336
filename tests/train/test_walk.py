"""Walk tau (dflash.train.walk): the engine's greedy walk replayed on a store of the target's own replies.

A drafter whose layers write nothing (o_proj and down_proj zero) proposes one fixed token `c` at every block
position, whatever its context: its acceptance at each anchor is known from the reply's tokens alone.  With
it the walk is checked against a plain loop over the store's tokens (anchors, stops, the reply it follows).
Against the lossless online eval it is compared on the real target by the walk benchmark (bench/).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import build_store, make_tiny_target

B = 8
WORDS = "one two three four five".split()


def fixed_token_drafter(target_dir: Path, layer_ids, c: int, mask_token_id: int):
    """A DFlash drafter proposing token `c` everywhere: its layers add nothing to the block's embeddings and
    its final norm's weight maps the mask token's embedding onto lm_head's row `c`."""
    from dflash.drafter import DFlashDrafter, DrafterConfig
    from dflash.target_model.files import load_embed_and_head, target_config

    cfg = DrafterConfig.from_target(target_config(target_dir), num_layers=1, block_size=B,
                                    target_layer_ids=list(layer_ids), mask_token_id=mask_token_id)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).float().eval()
    embed, head = load_embed_and_head(target_dir)
    embed, head = embed.float(), head.float()
    with torch.no_grad():
        for layer in drafter.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        x = embed[mask_token_id]
        unit = x / x.pow(2).mean().add(cfg.rms_norm_eps).sqrt()
        drafter.norm.weight.copy_(head[c] / unit)
    assert int((head @ drafter.norm(x)).argmax()) == c  # what every block position proposes
    return drafter, embed, head


def reference_walk(ids: np.ndarray, loss_mask: np.ndarray, c: int, max_new_tokens: int) -> list[int]:
    """The engine's steps on one reply for a drafter that proposes `c`, written out plainly."""
    sup = np.flatnonzero(loss_mask)
    last = int(sup[-1])
    first = last
    while first > 0 and loss_mask[first - 1]:
        first -= 1
    a, emitted, steps = first, 1, []
    while True:
        m = 0
        while m < B - 1 and a + 1 + m <= last and ids[a + 1 + m] == c:
            m += 1
        steps.append(m + 1)
        emitted += m + 1
        a += m + 1
        if emitted >= max_new_tokens or a >= last:
            return steps


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def runs_store(tmp_path_factory):
    """A store whose replies hold runs of one word: single- and multi-turn, short and long."""
    import random

    tmp = tmp_path_factory.mktemp("walk")
    target = make_tiny_target(tmp)
    rng = random.Random(5)
    rows = []
    for i in range(14):
        words = 150 if i in (0, 9) else rng.randint(3, 60)  # two longer than a 128-token row
        reply = " ".join("two" if rng.random() < 0.7 else rng.choice(WORDS) for _ in range(words))
        msgs = [{"role": "user", "content": "say two"}]
        if i % 3 == 0:  # an earlier exchange: the walk follows the last reply only
            msgs += [{"role": "assistant", "content": "two two two"}, {"role": "user", "content": "again"}]
        rows.append({"messages": msgs + [{"role": "assistant", "content": reply}]})
    data = tmp / "runs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return target, build_store(tmp / "store", target, data, writer="thread")


@pytest.mark.parametrize("max_new_tokens", [128, 12])
def test_walk_matches_a_plain_loop_over_the_replies(runs_store, max_new_tokens):
    from dflash.store import open_store
    from dflash.target_model.capture import load_tokenizer
    from dflash.train.walk import walk_tau

    target, store_dir = runs_store
    store = open_store(store_dir)
    tok = load_tokenizer(target)
    c = tok.encode(" two", add_special_tokens=False)
    assert len(c) == 1
    c = c[0]
    drafter, embed, head = fixed_token_drafter(target, store.target_layer_ids, c, mask_token_id=len(tok) - 1)
    want = []
    for sid in store.sample_ids():
        d = store.read(sid, fields=("input_ids", "loss_mask"))
        want += reference_walk(d["input_ids"].numpy(), d["loss_mask"].numpy().astype(bool), c, max_new_tokens)
    # rows of a few samples each, and micro-batches of two rows: the blocks' bookkeeping across both
    got = walk_tau(drafter, embed, head, store, max_new_tokens=max_new_tokens, token_budget=256,
                   rows_per_batch=2, progress=False)
    assert got["num_samples"] == len(store)
    assert got["num_blocks"] == len(want)
    assert got["tau_hist"] == np.bincount(want, minlength=B + 1)[1:].tolist()
    assert got["tau"] == pytest.approx(np.mean(want))
    assert max(want) == B and got["tau"] > 1.2  # runs of " two" are accepted whole: a walk worth checking
    # the replies still walking packed anew once they fit in fewer micro-batches: the same steps, fewer calls
    kept = walk_tau(drafter, embed, head, store, max_new_tokens=max_new_tokens, token_budget=256,
                    rows_per_batch=2, progress=False, repack=False)
    assert kept["tau_hist"] == got["tau_hist"] and kept["num_blocks"] == got["num_blocks"]
    assert got["num_calls"] < kept["num_calls"], (got["num_calls"], kept["num_calls"])


def test_samples_longer_than_a_row_are_left_out_whole(runs_store):
    """A sample cut to the row budget loses the reply the walk follows (its last supervised run would be an
    earlier turn, or a reply's head taken for the whole): the walk leaves it out and counts it."""
    from dflash.errors import StoreError
    from dflash.store import open_store
    from dflash.target_model.capture import load_tokenizer
    from dflash.train.walk import walk_tau

    target, store_dir = runs_store
    store = open_store(store_dir)
    tok = load_tokenizer(target)
    c = tok.encode(" two", add_special_tokens=False)[0]
    drafter, embed, head = fixed_token_drafter(target, store.target_layer_ids, c, mask_token_id=len(tok) - 1)
    budget = 128  # one tile: the row shape is exactly this budget
    want, too_long = [], 0
    for sid in store.sample_ids():
        d = store.read(sid, fields=("input_ids", "loss_mask"))
        if len(d["input_ids"]) > budget:
            too_long += 1
            continue
        want += reference_walk(d["input_ids"].numpy(), d["loss_mask"].numpy().astype(bool), c, 128)
    assert 0 < too_long < len(store)  # both kinds present: the check can fail
    got = walk_tau(drafter, embed, head, store, token_budget=budget, rows_per_batch=2, progress=False)
    assert got["num_too_long"] == too_long and got["num_samples"] == len(store) - too_long
    assert got["num_blocks"] == len(want) and got["tau"] == pytest.approx(np.mean(want))
    assert store.lengths()[0] > budget  # the first sample alone: nothing left to walk
    with pytest.raises(StoreError, match="no sample of store"):
        walk_tau(drafter, embed, head, store, max_samples=1, token_budget=budget, progress=False)


def test_a_step_after_an_eval_or_a_checkpoint_is_timed_without_it(runs_store, tmp_path, monkeypatch):
    import time

    from dflash.config import TrainConfig
    from dflash.train.trainer import Trainer, run_training

    pause = 1.5
    for name in ("_heldout_eval", "save"):
        inner = getattr(Trainer, name)
        monkeypatch.setattr(Trainer, name, lambda self, inner=inner: time.sleep(pause) or inner(self))
    target, store = runs_store
    cfg = TrainConfig(store=str(store), target=str(target), out=str(tmp_path / "run"), gpus="cpu:1", block_size=B,
                      num_layers=1, steps=6, lr=3e-3, warmup_steps=1, token_budget=256, num_anchors=8, num_workers=1,
                      compile="off", seed=0, save_every=4, eval_every=2, eval_store=str(store))
    run_training(cfg)
    recs = {r["step"]: r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())}
    seconds = {s: r["ctx_tokens"] / r["ctx_tokens_per_s"] for s, r in recs.items()}
    assert [s for s, r in recs.items() if "eval_tau" in r] == [2, 4, 6]
    assert all(seconds[s] < pause for s in (3, 5)), seconds  # after an eval; after an eval and a checkpoint


def test_training_records_the_walk_at_each_heldout_eval(runs_store, tmp_path):
    from dflash.config import TrainConfig
    from dflash.train.trainer import run_training

    target, store = runs_store
    cfg = TrainConfig(store=str(store), target=str(target), out=str(tmp_path / "run"), gpus="cpu:1", block_size=B,
                      num_layers=1, steps=4, lr=3e-3, warmup_steps=1, token_budget=256, num_anchors=8, num_workers=1,
                      compile="off", seed=0, save_every=0, eval_every=2, eval_store=str(store), eval_walk_tokens=16)
    run_training(cfg)
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    walks = [(r["step"], r["eval_walk_tau"]) for r in recs if "eval_walk_tau" in r]
    assert [s for s, _ in walks] == [2, 4]
    assert all(1.0 <= t <= B for _, t in walks)
    assert all("eval_tau" in r for r in recs if "eval_walk_tau" in r)
    assert all(r["eval_s"] > 0 and r["eval_walk_s"] > 0 for r in recs if "eval_walk_tau" in r)  # what each costs

    # `dflash eval --walk` on the last checkpoint: the same walk, packed otherwise (whole samples a row)
    from dflash.config import EvalConfig
    from dflash.evaluate.run import run_eval

    res = run_eval(EvalConfig(run=str(tmp_path / "run"), store=str(store), walk=True, max_new_tokens=16,
                              plots=False, device="cpu", out=str(tmp_path / "eval.json")))
    assert res["offline"]["walk"]["tau"] == pytest.approx(walks[-1][1], abs=1e-9)
    from dflash.cli import eval_summary

    w = res["offline"]["walk"]
    assert f"walk tau = {w['tau']:.3f} over {w['num_blocks']} steps of {w['num_samples']} replies" in eval_summary(res)


@pytest.mark.slow
def test_evals_at_one_padded_shape_give_the_same_taus_and_compile_once(runs_store):
    """Training's evals of a compiled drafter use one padded shape (num_shapes=1): every shape a compiled
    drafter meets is a compilation (~30 s on an H100).  Padding must change no tau, and the walk of a
    compiled drafter must then compile one graph where, with three shapes, it compiles one a shape."""
    from torch._dynamo.utils import counters

    from dflash.store import open_store
    from dflash.target_model.capture import load_tokenizer
    from dflash.train.heldout import offline_tau
    from dflash.train.walk import walk_tau

    target, store_dir = runs_store
    store = open_store(store_dir)
    tok = load_tokenizer(target)
    c = tok.encode(" two", add_special_tokens=False)[0]
    drafter, embed, head = fixed_token_drafter(target, store.target_layer_ids, c, mask_token_id=len(tok) - 1)
    budget = 256  # rows of 1-4 replies: some fill 256 tokens, some fit 128 (the shapes at this budget)

    def walk(n: int):
        return walk_tau(drafter, embed, head, store, token_budget=budget, rows_per_batch=1, num_shapes=n,
                        progress=False)

    def compiled_graphs(n: int) -> tuple[int, dict]:
        torch._dynamo.reset()
        drafter.compile(dynamic=False)
        before = counters["stats"]["unique_graphs"]
        res = walk(n)
        return counters["stats"]["unique_graphs"] - before, res

    w3, w1 = walk(3), walk(1)
    assert w1["tau_hist"] == w3["tau_hist"] and w1["num_blocks"] == w3["num_blocks"] > 0
    o3, o1 = (offline_tau(drafter, embed, head, store, num_anchors=8, token_budget=budget, block_budget=budget,
                          num_shapes=n, progress=False) for n in (3, 1))
    assert o1["tau_hist"] == o3["tau_hist"] and o1["tau"] == pytest.approx(o3["tau"])

    (g3, c3), (g1, c1) = compiled_graphs(3), compiled_graphs(1)
    assert g3 > 1 and g1 == 1
    assert c3["tau_hist"] == c1["tau_hist"] == w3["tau_hist"]
