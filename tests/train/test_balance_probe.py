"""bench/balance_probe.py: the replay of an order's two-process steps from per-micro-batch times."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import balance_probe  # noqa: E402
from dflash.train import loader as L  # noqa: E402
from dflash.train import plan as P  # noqa: E402


def test_replay_pairs_consecutive_micro_batches_and_drops_the_odd_tail():
    t = {"a": 1.0, "b": 3.0, "c": 1.0, "d": 3.0, "e": 9.0}
    tok = dict.fromkeys(t, 10)
    r = balance_probe.replay(["a", "b", "c", "d", "e"], t, tok, opt_s=0.5)
    assert r["steps"] == 2 and r["ctx_tokens"] == 40  # "e" is the tail RankSampler leaves out
    assert r["one_gpu_s"] == pytest.approx(1 + 3 + 1 + 3 + 4 * 0.5)
    assert r["two_gpu_s"] == pytest.approx(3 + 0.5 + 3 + 0.5)
    assert r["ideal_2_over_1"] == pytest.approx(10 / 7, abs=1e-4)
    assert r["balance_efficiency"] == pytest.approx((2 + 2) / (3 + 3), abs=1e-4)
    assert r["step_spread_max_over_min_max"] == pytest.approx(3.0)
    balanced = balance_probe.replay(["a", "c", "b", "d"], t, tok, opt_s=0.5)
    assert balanced["two_gpu_s"] == pytest.approx(1 + 0.5 + 3 + 0.5)
    assert balanced["balance_efficiency"] == pytest.approx(1.0)
    assert balanced["ideal_2_over_1"] == pytest.approx(2.0, abs=1e-4)


def test_first_version_order_is_a_permutation_sorted_within_groups_of_16():
    rng = np.random.default_rng(3)
    lengths = np.clip(rng.lognormal(np.log(300), 0.6, 400), 40, 1024).astype(int)
    spec = L.LoaderSpec(block_size=16, num_anchors=16, token_budget=1024, block_budget=1024, rows_per_batch=2,
                        mask_token_id=5, num_shapes=1)
    blocks = np.minimum(lengths - 1, spec.max_blocks)
    plan = P.plan_epoch(lengths, blocks, spec, 0)
    ctx, blk = np.minimum(lengths, 1024), blocks * 16
    order = balance_probe.first_version_order(plan.batches, ctx, blk, spec, 0, 0)
    assert sorted(order.tolist()) == list(range(len(plan)))
    costs = [P.batch_cost(plan.batches[g], ctx, blk, spec) for g in order]
    groups = [costs[i : i + 16] for i in range(0, len(costs), 16)]
    assert len(groups) > 2 and all(g == sorted(g) for g in groups)  # each group a run of the cost order
    assert costs != sorted(costs)  # and the groups in random order
