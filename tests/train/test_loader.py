"""The loader: anchors and labels per docs/DESIGN.md §3, packing under budgets, rank splits, resume points."""

import numpy as np
import pytest
import torch
from test_batch import _same

from dflash.drafter import masks
from dflash.errors import DataError
from dflash.train import loader as L
from dflash.train.loss import IGNORE, position_weights


def _mask(T, seed):
    rng = np.random.default_rng(seed)
    m = np.zeros(T, dtype=bool)
    m[T // 3 :] = True
    m[rng.choice(T, size=T // 6, replace=False)] = False  # holes: not every supervised token is an anchor
    return m


def test_anchors_follow_design():
    T = 200
    for seed in range(5):
        lm = _mask(T, seed)
        a = L.draw_anchors(lm, 16, seed=3, epoch=0, sample_id=seed)
        assert 0 < len(a) <= 16
        assert np.all(np.diff(a) > 0)  # sorted and distinct
        assert np.all(a + 1 < T) and lm[a].all() and lm[a + 1].all()
        assert np.array_equal(a, L.draw_anchors(lm, 16, seed=3, epoch=0, sample_id=seed))  # seeded
        assert not np.array_equal(a, L.draw_anchors(lm, 16, seed=3, epoch=1, sample_id=seed))  # per epoch
        assert not np.array_equal(a, L.draw_anchors(lm, 16, seed=4, epoch=0, sample_id=seed))  # per seed
    # few eligible positions: all of them; the last token can never be an anchor
    lm = np.array([0, 1, 1, 0, 1, 1, 1], dtype=bool)
    assert L.draw_anchors(lm, 16, 0, 0, 0).tolist() == [1, 4, 5]


def test_block_labels_and_weights():
    ids = np.arange(100, 110)
    lm = np.array([0, 0, 1, 1, 1, 0, 1, 1, 1, 1], dtype=bool)
    B = 4
    w = position_weights(B, gamma=2.0).numpy()
    t = L.block_targets(ids, lm, np.array([2, 7]), B, mask_token_id=999, weights=w)
    assert t["input_ids"].tolist() == [102, 999, 999, 999, 107, 999, 999, 999]
    assert t["positions"].tolist() == [2, 3, 4, 5, 7, 8, 9, 10]
    # position 5 is unsupervised, position 10 is past the sample: ignored with weight 0
    assert t["labels"].tolist() == [IGNORE, 103, 104, IGNORE, IGNORE, 108, 109, IGNORE]
    assert np.allclose(t["weights"], [0, 1, np.exp(-0.5), 0, 0, 1, np.exp(-0.5), 0])
    assert t["source"][1] == 2  # the target's distribution for token 3 sits at position 2


def _spec(**kw):
    base = dict(block_size=4, num_anchors=8, token_budget=256, block_budget=256, rows_per_batch=2,
                mask_token_id=0, seed=0)
    base.update(kw)
    return L.LoaderSpec(**base)


def test_shapes():
    assert L.shape_set(4096, 3) == [1024, 2048, 4096]
    assert L.shape_set(300, 3) == [128, 256, 384]
    assert L.fit_shape(129, [128, 256]) == 256


def test_plan_packs_under_budget_and_is_deterministic():
    rng = np.random.default_rng(0)
    n = 500
    lengths = rng.integers(5, 100, n)
    lengths[:5] = 1000  # longer than the row budget: cut to it
    max_blocks = np.minimum(rng.integers(0, 20, n), 8)
    spec = _spec()
    plan = L.plan_epoch(lengths, max_blocks, spec, epoch=0)
    S, Qb = spec.s_shapes[-1], spec.q_shapes[-1]
    seen = []
    for batch in plan.batches:
        assert 1 <= len(batch) <= spec.rows_per_batch
        for row in batch:
            assert np.minimum(lengths[row], S).sum() <= S
            assert (max_blocks[row] * spec.block_size).sum() <= Qb
            seen += row.tolist()
    # every sample with something to learn appears exactly once per epoch; the rest never
    assert sorted(seen) == np.flatnonzero(max_blocks > 0).tolist()
    # packing puts several samples in a row
    assert np.mean([len(r) for b in plan.batches for r in b]) > 2
    again = L.plan_epoch(lengths, max_blocks, spec, epoch=0)
    assert all(all(np.array_equal(x, y) for x, y in zip(a, b)) for a, b in zip(plan.batches, again.batches))
    other = L.plan_epoch(lengths, max_blocks, spec, epoch=1)
    assert [r.tolist() for b in other.batches for r in b] != [r.tolist() for b in plan.batches for r in b]
    # resume points are prefix boundaries in samples
    g = len(plan) // 2
    assert plan.batch_at_samples(int(plan.samples_before[g])) == g
    assert plan.samples_before[g + 1] - plan.samples_before[g] > 1
    with pytest.raises(Exception, match="not a micro-batch boundary"):
        plan.batch_at_samples(int(plan.samples_before[g]) + 1)


def test_plan_balances_each_step_and_keeps_steps_in_random_order():
    """A step lasts as long as its slowest process: with balance_group = processes x accumulation, the
    micro-batches of a step should cost about the same (against a random order of the same micro-batches,
    a much smaller spread).  The steps themselves must stay in random order (sorted runs of steps cost
    the embedded default 10% of its tau), and balance_group 1 is the plain random order."""
    rng = np.random.default_rng(1)
    n = 3000
    lengths = np.clip(rng.lognormal(np.log(60), 0.6, n), 5, 400).astype(int)
    max_blocks = np.full(n, 4)
    ctx = np.minimum(lengths, _spec().s_shapes[-1])
    blk = max_blocks * _spec().block_size

    def costs(plan, spec):
        return np.array([L.batch_cost(b, ctx, blk, spec)[2] for b in plan.batches], dtype=float)

    def spread(c, world):
        steps = c[: len(c) // world * world].reshape(-1, world)
        return float(np.mean((steps.max(1) - steps.min(1)) / steps.max(1)))

    random_spec = _spec()
    random_cost = costs(L.plan_epoch(lengths, max_blocks, random_spec, epoch=0), random_spec)
    assert len(random_cost) > 64 and random_cost.max() > 1.5 * random_cost.min()  # micro-batches do differ
    for world in (2, 4):
        spec = _spec(balance_group=world)
        plan = L.plan_epoch(lengths, max_blocks, spec, epoch=0)
        c = costs(plan, spec)
        assert sorted(c) == sorted(random_cost)  # the same micro-batches, another order
        assert spread(c, world) < spread(random_cost, world) / 3
        step_cost = c[: len(c) // world * world].reshape(-1, world).mean(1)
        ranks = np.argsort(np.argsort(step_cost))
        assert abs(np.corrcoef(np.arange(len(ranks)), ranks)[0, 1]) < 0.3  # steps not sorted by cost
        assert abs(np.corrcoef(ranks[:-1], ranks[1:])[0, 1]) < 0.3  # nor in runs of similar cost
        other = L.plan_epoch(lengths, max_blocks, spec, epoch=1)
        assert [r.tolist() for r in other.batches[0]] != [r.tolist() for r in plan.batches[0]]


class _FakePlans:
    def __init__(self, sizes):
        self.sizes = sizes

    def plan(self, epoch):
        return list(range(self.sizes[epoch % len(self.sizes)]))


def test_ranks_disjoint_and_covering():
    ds = _FakePlans([23, 17])
    W, A, steps = 3, 2, 5
    per_rank = [list(L.RankSampler(ds, r, W, A, 0, 0, steps)) for r in range(W)]
    everything = [k for keys in per_rank for k in keys]
    assert len(everything) == len(set(everything)) == W * A * steps
    # epoch 0: 23 micro-batches -> 3 steps of 6 (the 5 left over are skipped), then epoch 1
    assert {g for e, g in everything if e == 0} == set(range(18))
    assert {g for e, g in everything if e == 1} == set(range(12))
    # one process with W*A accumulation steps sees the same micro-batches per step
    single = list(L.RankSampler(ds, 0, 1, W * A, 0, 0, steps))
    assert sorted(single) == sorted(everything)
    # a resume point mid-epoch continues from there on any world size
    resumed = list(L.RankSampler(ds, 0, 1, 2, 0, 12, 1))
    assert resumed == [(0, 12), (0, 13)]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from train_fixtures import build_counting_store

    target, store = build_counting_store(tmp_path_factory.mktemp("loader"), n=24, teach=False)
    from dflash.store import open_store

    return open_store(store)


def test_batches_from_a_real_store(store):
    spec = _spec(token_budget=256, block_budget=128, num_anchors=4, kd=True, mask_token_id=7)
    ds = L.PackedDataset(store, spec)
    plan = ds.plan(0)
    assert len(plan) >= 2
    b = ds[(0, 0)]
    R, S = b.ctx_positions.shape
    Q = b.labels.shape[1]
    assert S in spec.s_shapes and Q in spec.q_shapes and R == spec.rows_per_batch
    assert b.ctx_hidden.dtype == torch.bfloat16 and b.ctx_hidden.shape[-1] == store.hidden_size * 2
    # labels are the sample's own tokens at anchor + k, and the first block token is the anchor's token
    sid = int(b.sample_ids[0])
    d = store.read(sid)
    row0 = b.labels[0]
    anchors = b.block_positions[0, :: spec.block_size]
    a0 = int(anchors[0])
    assert int(b.block_input_ids[0, 0]) == int(d["input_ids"][a0])
    assert (b.block_input_ids[0, 1 : spec.block_size] == 7).all()
    for k in range(1, spec.block_size):
        if int(row0[k]) != IGNORE:
            assert int(row0[k]) == int(d["input_ids"][a0 + k]) and bool(d["loss_mask"][a0 + k])
            # KD targets: the target's top-k at the previous position
            assert torch.equal(b.topk_ids[0, k], d["topk_ids"][a0 + k - 1])
    # mask metadata: what flex would apply equals the rule on the descriptors
    bm = masks.to_block_mask(b.mask)
    assert torch.equal(masks.block_mask_to_dense(bm)[:, 0], masks.dense_mask(b.mask))
    # context of the first sample sits at the start of row 0 with positions 0..T-1
    T = min(len(d["input_ids"]), S)
    assert b.ctx_positions[0, :T].tolist() == list(range(T))
    assert torch.equal(b.ctx_hidden[0, :T], d["hidden"][:T])


def test_target_labels_are_the_stored_top1(store):
    """--labels target: every supervised position is labelled with the target's greedy token (top-1 at the
    position before it), the same positions as --labels data; inputs and weights do not change."""
    spec = _spec(token_budget=256, block_budget=128, num_anchors=4, mask_token_id=7)
    data = L.PackedDataset(store, spec)[(0, 0)]
    tgt = L.PackedDataset(store, L.LoaderSpec(**{**spec.__dict__, "target_labels": True}))[(0, 0)]
    assert torch.equal(data.block_input_ids, tgt.block_input_ids) and torch.equal(data.loss_weight, tgt.loss_weight)
    assert torch.equal(data.labels == IGNORE, tgt.labels == IGNORE)
    d = store.read(int(tgt.sample_ids[0]))  # the first sample of row 0 holds its first blocks
    a0 = int(tgt.block_positions[0, 0])
    checked = 0
    for k in range(1, spec.block_size):
        if int(tgt.labels[0, k]) != IGNORE:
            assert int(tgt.labels[0, k]) == int(d["topk_ids"][a0 + k - 1, 0])
            checked += 1
    assert checked >= 1
    # the target here was never taught the data: its greedy tokens are not the data's
    supervised = tgt.labels != IGNORE
    assert (tgt.labels[supervised] != data.labels[supervised]).any()


def test_rollout_reach_by_hand():
    """Block position k is reached by the target's greedy walk from the anchor when the data's tokens at
    anchor + 1 .. anchor + k - 1 equal the target's greedy token one position before each."""
    ids = np.array([5, 6, 7, 8, 9, 10, 11, 12])
    top1 = np.array([6, 7, 0, 9, 10, 0, 12, 0])  # the data agrees at 1, 2, 4, 5, 7 (not at 3 or 6)
    blocks = L.block_targets(ids, np.ones(8, bool), np.array([0, 3]), 4, 99, np.ones(4))
    reach = L.rollout_reach(blocks, ids, top1[:, None], 4)
    # anchor 0: k=1 yes; k=2: data agrees at 1; k=3: and at 2. anchor 3: k=2: agrees at 4; k=3: and at 5
    assert reach.tolist() == [True, True, True, True, True, True, True, True]
    blocks = L.block_targets(ids, np.ones(8, bool), np.array([1, 4]), 4, 99, np.ones(4))
    reach = L.rollout_reach(blocks, ids, top1[:, None], 4)
    # anchor 1: k=2 needs agreement at 2 (yes), k=3 at 2 and 3 (3 disagrees); anchor 4: k=2 at 5 (yes), k=3 at 6 (no)
    assert reach.tolist() == [True, True, True, False, True, True, True, False]


def test_rollout_labels_keep_the_target_labels_the_walk_reaches(store):
    """--labels rollout: the target labels of --labels target where the target's greedy walk from the anchor
    reaches the position, nothing elsewhere; with this untaught target the walk often leaves the data."""
    spec = _spec(token_budget=256, block_budget=128, num_anchors=4, mask_token_id=7, target_labels=True)
    tgt = L.PackedDataset(store, spec)[(0, 0)]
    roll = L.PackedDataset(store, L.LoaderSpec(**{**spec.__dict__, "rollout_labels": True}))[(0, 0)]
    kept = roll.labels != IGNORE
    assert torch.equal(roll.labels[kept], tgt.labels[kept]) and (kept <= (tgt.labels != IGNORE)).all()
    assert (roll.loss_weight[~kept] == 0).all() and torch.equal(roll.loss_weight[kept], tgt.loss_weight[kept])
    assert 0 < int(kept.sum()) < int((tgt.labels != IGNORE).sum())
    # every kept position k >= 2 of the first sample's blocks: the data agreed with the target before it
    d = store.read(int(roll.sample_ids[0]))
    ids, top1 = d["input_ids"], d["topk_ids"][:, 0]
    B = spec.block_size
    checked, first = 0, int((roll.mask["q_sample"][0] == 0).sum())  # the first sample's block positions
    assert first >= B
    for b0 in range(0, first, B):
        a = int(roll.block_positions[0, b0])
        for k in range(2, B):
            if a + k < len(ids) and int(tgt.labels[0, b0 + k]) != IGNORE:
                agree = all(int(ids[a + j]) == int(top1[a + j - 1]) for j in range(1, k))
                assert bool(kept[0, b0 + k]) == agree, (a, k)
                checked += 1
    assert checked > 0


def test_target_agreement_counts_supervised_tokens_the_target_would_write(store):
    """The share of supervised tokens equal to the stored top-1 one position earlier, by hand over the same
    samples; a store without top-k has none."""
    share, n = L.target_agreement(store, max_samples=5)
    agree = total = 0
    for sid in store.sample_ids()[:5]:
        d = store.read(sid)
        for p in range(1, len(d["input_ids"])):
            if bool(d["loss_mask"][p]):
                total += 1
                agree += int(d["input_ids"][p]) == int(d["topk_ids"][p - 1, 0])
    assert n == total > 0 and share == agree / total and 0 < share < 1  # an untaught target: some, not all

    class NoTopk:
        topk = 0

    assert L.target_agreement(NoTopk()) is None


def test_workers_build_batches(store):
    """Through a real DataLoader with a worker process: same batches as built in-process."""
    spec = _spec(token_budget=256, block_budget=128, num_anchors=4)
    ds = L.PackedDataset(store, spec)
    sampler = L.RankSampler(ds, 0, 1, 1, 0, 0, 2)
    got = list(L.make_loader(ds, sampler, num_workers=1))
    assert [(x.epoch, x.index) for x in got] == [(0, 0), (0, 1)]
    for x in got:
        ref = ds[(x.epoch, x.index)]
        _same(ref, x)  # every field, the arena's views included
        assert all(x._in_arena(t) for t in (x.labels, x.label_index, *x.mask.values()))


def test_store_too_small_for_one_step():
    from dflash.errors import DataError

    with pytest.raises(DataError, match="fewer than one optimizer step"):
        list(L.RankSampler(_FakePlans([3]), 0, 2, 2, 0, 0, 1))


def test_hidden_read_straight_into_batches(store):
    """bf16 hidden states are decoded by Zarr straight into the packed batch: every sample's rows equal
    Store.read, padding is zero, and worker-built (shared-memory) batches equal in-process ones."""
    spec = _spec(token_budget=256, block_budget=128, num_anchors=4)
    ds = L.PackedDataset(store, spec)
    for g in range(len(ds.plan(0))):
        b = ds[(0, g)]
        c0, r = 0, 0
        for sid in b.sample_ids.tolist():
            h = store.read(sid)["hidden"]
            T = min(len(h), spec.s_shapes[-1])
            if c0 + T > b.ctx_hidden.shape[1]:  # next row
                assert (b.ctx_hidden[r, c0:] == 0).all()
                r, c0 = r + 1, 0
            assert torch.equal(b.ctx_hidden[r, c0 : c0 + T], h[:T]), (g, sid)
            c0 += T
        assert (b.ctx_hidden[r, c0:] == 0).all()
    sampler = L.RankSampler(ds, 0, 1, 1, 0, 0, 2)
    for x in L.make_loader(ds, sampler, num_workers=1):
        assert x.ctx_hidden.is_shared()
        assert torch.equal(x.ctx_hidden, ds[(x.epoch, x.index)].ctx_hidden)


def _fed(feeder):
    """The feeder's micro-batches, one per step, until the loader is done."""
    while True:
        try:
            (item,) = feeder.take()
        except StopIteration:
            return
        yield feeder.ready(item)


def test_batch_slots_carry_context_features(store):
    """With batch slots, workers write context features into shared slots and only the slot's number
    crosses to the trainer; through DeviceFeeder (2 slots for 2 workers: every slot reused many times,
    workers waiting for them) every micro-batch equals the one built in-process, and every slot is
    released in order."""
    from dflash.train.batch_slots import BatchSlots
    from dflash.train.feeder import DeviceFeeder

    spec = _spec(token_budget=256, block_budget=128, num_anchors=4)
    ds = L.PackedDataset(store, spec)
    width = store.hidden_size * store.num_layers
    steps = 3 * len(ds.plan(0))  # three epochs
    direct = BatchSlots(steps + 1, L.batch_bytes(spec, width))  # enough slots that nothing waits
    raw = list(L.make_loader(ds, L.RankSampler(ds, 0, 1, 1, 0, 0, steps), num_workers=2, slots=direct))
    assert [x.seq for x in raw] == list(range(steps))
    assert all(x.slot == x.seq and x.ctx_hidden is None for x in raw)

    slots = BatchSlots(2, L.batch_bytes(spec, width))
    loader = L.make_loader(ds, L.RankSampler(ds, 0, 1, 1, 0, 0, steps), num_workers=2, slots=slots)
    feeder = DeviceFeeder(loader, torch.device("cpu"), per_step=1, slots=slots)
    seen = 0
    for b in _fed(feeder):
        ref = ds[(b.epoch, b.index)]
        assert b.slot is None and b.seq is None
        assert torch.equal(b.ctx_hidden, ref.ctx_hidden) and torch.equal(b.labels, ref.labels)
        seen += 1
    assert seen == steps
    # each slot's counter names the first micro-batch that may use it next: the last user + 2
    assert slots.next_seq.tolist() == [max(q for q in range(steps) if q % 2 == s) + 2 for s in range(2)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("with_slots", [False, True])
def test_feeder_brings_pinned_micro_batches_to_the_gpu(store, with_slots):
    """On a GPU the loader pins each MicroBatch (or its features sit in page-locked slots) and the feeder
    copies it on its side stream: every tensor, the mask's included, arrives on the device unchanged."""
    from dflash.train.batch_slots import BatchSlots
    from dflash.train.feeder import DeviceFeeder

    spec = _spec(token_budget=256, block_budget=128, num_anchors=4)
    ds = L.PackedDataset(store, spec)
    steps, dev = 2 * len(ds.plan(0)), torch.device("cuda")
    slots = BatchSlots(3, L.batch_bytes(spec, store.hidden_size * store.num_layers), pin=True) if with_slots else None
    loader = L.make_loader(ds, L.RankSampler(ds, 0, 1, 1, 0, 0, steps), num_workers=1, pin_memory=True, slots=slots)
    feeder = DeviceFeeder(loader, dev, per_step=1, slots=slots)
    seen = 0
    try:
        for b in _fed(feeder):
            assert all(t.device.type == "cuda" for t in b.tensors()) and b.ctx_hidden is not None
            ref = ds[(b.epoch, b.index)].to(dev)
            for name in ("ctx_hidden", "ctx_positions", "labels", "loss_weight", "label_index", "sample_ids"):
                assert torch.equal(getattr(b, name), getattr(ref, name)), name
            assert all(torch.equal(b.mask[k], ref.mask[k]) for k in ref.mask)
            assert b.loss_weight_sum == ref.loss_weight_sum and b.slot is None and b.seq is None
            seen += 1
    finally:
        feeder.close()
        if slots is not None:
            slots.close()
    assert seen == steps


def test_feeder_releases_slots_in_order():
    """Slots are released oldest first, as their copies finish; a copy still running holds back the
    slots after it, except the one the next micro-batch needs, which is waited for (never a deadlock)."""
    from dflash.train.batch_slots import BatchSlots
    from dflash.train.feeder import DeviceFeeder

    class Copy:  # a CUDA event stand-in: finished or not, and whether the feeder waited for it
        def __init__(self, done):
            self.done, self.waited = done, False

        def query(self):
            return self.done

        def synchronize(self):
            self.waited, self.done = True, True

    slots = BatchSlots(4, 8)
    feeder = DeviceFeeder(iter(()), torch.device("cpu"), per_step=1, slots=slots)
    copies = [Copy(True), Copy(False), Copy(True), Copy(False)]
    feeder._held.extend(enumerate(copies))
    feeder._fetched = 4  # the next micro-batch, seq 4, reuses seq 0's slot
    feeder._release()
    assert [seq for seq, _ in feeder._held] == [1, 2, 3] and slots.next_seq.tolist() == [4, 1, 2, 3]
    feeder._fetched = 5  # seq 5 needs seq 1's slot: its copy is waited for, then seq 2 goes too
    feeder._release()
    assert copies[1].waited and not copies[3].waited
    assert [seq for seq, _ in feeder._held] == [3] and slots.next_seq.tolist() == [4, 5, 6, 3]
    with pytest.raises(DataError, match="before micro-batch 2"):
        slots.acquire(2)  # slot 2 already belongs to micro-batch 6: the loader's order was broken


_ORPHAN_PARENT = """
import os, sys, time
import torch.multiprocessing as mp
from dflash.train.batch_slots import BatchSlots


def wait_for_slot(slots, pidfile):
    open(pidfile + ".tmp", "w").write(str(os.getpid()))
    os.replace(pidfile + ".tmp", pidfile)  # started, slots received: the test never reads half a pid
    slots.acquire(1)  # slot 0 belongs to micro-batch 0, which nobody will release


if __name__ == "__main__":
    slots = BatchSlots(1, 8)
    mp.get_context("spawn").Process(target=wait_for_slot, args=(slots, sys.argv[1])).start()
    time.sleep(600)  # the trainer: alive, busy, releasing nothing

"""


def test_worker_waiting_for_a_slot_dies_with_its_trainer(tmp_path):
    """A worker may wait for a slot as long as its trainer lives, and no longer: kill -9 of the trainer
    makes it raise and exit instead of polling forever."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    script, pidfile = tmp_path / "parent.py", tmp_path / "worker.pid"
    script.write_text(_ORPHAN_PARENT)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    parent = subprocess.Popen([sys.executable, str(script), str(pidfile)], env=env, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not pidfile.is_file():
        assert parent.poll() is None and time.time() < deadline, parent.stderr.read().decode()[-2000:]
        time.sleep(0.05)
    worker = int(pidfile.read_text())
    try:
        time.sleep(1.0)
        assert _running(worker)  # waiting, not finished
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        gone = time.time() + 30
        while _running(worker):
            assert time.time() < gone, "the worker outlived its parent"
            time.sleep(0.05)
    finally:
        for pid in (parent.pid, worker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _running(pid: int) -> bool:
    """Alive and not a zombie (a dead child of a dead parent may linger as one until reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("hidden_dtype", ["bf16", "fp8"])
def test_read_hidden_into_across_objects_and_tail(tmp_path, hidden_dtype):
    """Store.read_hidden_into over Zarr objects and the committed tail of a shard still being written: bf16
    rows as stored; fp8 bits and scales as stored, which dequantise to exactly what Store.read gives."""
    from dflash.store import ShardWriter, create_or_check_manifest, open_store
    from dflash.store.rows import dequantise_fp8

    H, Ly = 16, 2
    fp8 = hidden_dtype == "fp8"
    root = tmp_path / "s"
    create_or_check_manifest(root, {
        "target": {"path": "/t", "config_hash": "abc", "hidden_size": H, "num_hidden_layers": 4, "vocab_size": 100},
        "tokenizer_hash": "tok", "dataset_fingerprint": "d", "target_layer_ids": [1, 2], "hidden_dtype": hidden_dtype,
        "topk": 0, "max_length": 64, "num_shards": 1})
    g = torch.Generator().manual_seed(0)
    hid = {}
    with ShardWriter(root, 0, hidden_width=H * Ly, num_layers=Ly, hidden_dtype=hidden_dtype, topk=0,
                     commit_every_tokens=40, chunk_tokens=8, chunks_per_object=4, flush_tokens=32, durable=False) as w:
        for sid in range(12):
            t = 3 + (sid * 7) % 17
            hid[sid] = (torch.randn(t, H * Ly, generator=g) * (1 + sid)).bfloat16()
            w.append(sid, sid, torch.randint(0, 100, (t,), generator=g), torch.ones(t, dtype=torch.uint8), hid[sid])
        w.commit()
        s = open_store(root)
        assert s.shards[0].zarr_end < s.shards[0].end  # part of it sits in the tail file
        for sid in range(12):
            want = s.read(sid)["hidden"][:-1]
            n = len(hid[sid]) - 1
            if fp8:
                bits, scale = torch.full((n, H * Ly), 7, dtype=torch.uint8), torch.full((n, Ly), 7.0)
                s.read_hidden_into(sid, bits, scale)
                assert torch.equal(dequantise_fp8(bits, scale), want), sid
                assert not torch.equal(want, hid[sid][:-1])  # e4m3 is lossy: the check above is not bf16's
            else:
                out = torch.full((n, H * Ly), 7.0, dtype=torch.bfloat16)
                s.read_hidden_into(sid, out)
                assert torch.equal(out, hid[sid][:-1]) and torch.equal(out, want), sid
        with pytest.raises(ValueError, match="contiguous uint8" if fp8 else "contiguous bf16"):
            s.read_hidden_into(0, torch.zeros(2, H * Ly, dtype=torch.bfloat16 if fp8 else torch.float32))
        if fp8:
            with pytest.raises(ValueError, match="scale_out"):
                s.read_hidden_into(0, torch.zeros(2, H * Ly, dtype=torch.uint8))


def test_device_feeder_groups_steps_in_order(store):
    """DeviceFeeder hands out one optimizer step's micro-batches at a time, in order, the last step
    possibly short, then StopIteration; prefetch() is idempotent and the DataLoader wait is counted."""
    import dataclasses

    from dflash.train.feeder import DeviceFeeder

    one = L.PackedDataset(store, _spec(token_budget=256, block_budget=128, num_anchors=4))[(0, 0)]
    batches = [dataclasses.replace(one, index=i) for i in range(7)]
    feeder = DeviceFeeder(iter(batches), torch.device("cpu"), per_step=3)
    got = []
    while True:
        try:
            items = feeder.take()
        except StopIteration:
            break
        feeder.prefetch()
        feeder.prefetch()  # a second call must not skip a step
        got.append([feeder.ready(it).index for it in items])
    assert got == [[0, 1, 2], [3, 4, 5], [6]]
    assert feeder.wait_s >= 0.0
    with pytest.raises(StopIteration):
        feeder.take()


_TEMPDIR_SCRIPT = '''
import multiprocessing, multiprocessing.util, sys
import torch
from dflash.train import loader as L


class TempDirOf(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return str(multiprocessing.current_process()._config.get("tempdir"))


if __name__ == "__main__":
    ctx = L.worker_context()
    loader = torch.utils.data.DataLoader(TempDirOf(), batch_size=None, num_workers=2, multiprocessing_context=ctx)
    print(sorted(set(loader)), multiprocessing.util.get_temp_dir())
'''


def test_loader_workers_share_the_trainers_temporary_folder(tmp_path):
    """A loader worker with a temporary folder of its own removes it on its way out while its queue thread
    may still be sending (`Directory not empty`: a traceback after a failed run's message, seen in CI).
    In a fresh process, as a training run is, every worker must see the trainer's folder instead."""
    import subprocess
    import sys

    script = tmp_path / "tempdirs.py"
    script.write_text(_TEMPDIR_SCRIPT)
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    seen, trainers = p.stdout.strip().rsplit(" ", 1)
    assert seen == repr([trainers]), p.stdout
