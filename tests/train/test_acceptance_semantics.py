"""Training semantics that decide acceptance (DESIGN §3, §4), checked from their definitions.

Every check rebuilds the expected value with plain loops over a sample's own arrays (its tokens, loss
mask and features, and where the plan put it), not from the values under test, and runs on real tensors:
an in-memory store with the reader's interface,
real packed micro-batches from PackedDataset, the real masks, a tiny random drafter in float64 and the
training loss (block_loss).  The central property is packing invariance: a sample's contribution to
training (its blocks, their labels and weights, the drafter's output, loss and gradient on them) must
not depend on which samples share its row or micro-batch, nor on rows_per_batch / token_budget /
block_budget, as long as nothing is truncated.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dflash.drafter import DFlashDrafter, DrafterConfig, masks
from dflash.train import loader as L
from dflash.train.loss import IGNORE, block_loss, default_gamma, position_weights, reference_block_loss

torch.set_num_threads(1)

V, H, NL = 48, 16, 2  # vocabulary, hidden size, captured target layers
MASK_ID = V - 1


# ---------------------------------------------------------------------------------------------------
# an in-memory store (the reader's interface: sample_ids, lengths, num_supervised, read)


class ArrayStore:
    """Samples held in memory; `read` returns what dflash.store.reader.Store.read returns (float64
    hidden states here, so that packing comparisons are exact up to float64 rounding)."""

    hidden_dtype = "float64"  # not "bf16": the loader reads hidden states through read()
    hidden_size, num_layers = H, NL

    def __init__(self, samples: dict[int, dict[str, np.ndarray]]):
        self.samples = dict(sorted(samples.items()))

    def sample_ids(self):
        return list(self.samples)

    def lengths(self):
        return np.array([len(s["input_ids"]) for s in self.samples.values()], dtype=np.int64)

    def num_supervised(self):
        return np.array([int(s["loss_mask"].sum()) for s in self.samples.values()], dtype=np.int64)

    def read(self, sid, fields=None):
        s = self.samples[int(sid)]
        out = dict(input_ids=torch.from_numpy(s["input_ids"]).long(),
                   loss_mask=torch.from_numpy(s["loss_mask"]).bool(),
                   hidden=torch.from_numpy(s["hidden"]))
        return {k: v for k, v in out.items() if fields is None or k in fields}


def conversation_mask(T: int, rng) -> np.ndarray:
    """A chat-like loss mask: prompt unsupervised, one or two supervised replies, a few holes."""
    m = np.zeros(T, dtype=bool)
    p = int(rng.integers(1, max(2, T // 3)))
    m[p:] = True
    if T > 30 and rng.random() < 0.5:  # a second user turn in the middle
        u = int(rng.integers(p + 2, T - 5))
        m[u : u + int(rng.integers(2, 6))] = False
    holes = rng.choice(T, size=max(1, T // 15), replace=False)
    m[holes] = False
    return m


def make_samples(n=14, min_len=6, max_len=120, seed=0) -> dict[int, dict[str, np.ndarray]]:
    """Sample ids far from 0..n-1 (so an index/id mix-up cannot pass), random tokens and features."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n):
        T = int(rng.integers(min_len, max_len + 1))
        out[1000 + 37 * i] = dict(
            input_ids=rng.integers(0, V - 1, T).astype(np.int64),  # never the mask id
            loss_mask=conversation_mask(T, rng),
            hidden=rng.standard_normal((T, NL * H)),
        )
    return out


SAMPLES = make_samples()
B = 4  # block size of most checks


def spec(**kw) -> L.LoaderSpec:
    base = dict(block_size=B, num_anchors=5, token_budget=128, block_budget=128, rows_per_batch=2,
                mask_token_id=MASK_ID, seed=11)
    base.update(kw)
    return L.LoaderSpec(**base)


def dataset(samples=None, **kw) -> L.PackedDataset:
    return L.PackedDataset(ArrayStore(samples or SAMPLES), spec(**kw))


def built(ds: L.PackedDataset, epoch: int = 0):
    """[(rows as sample indices, batch)] for every micro-batch of the epoch's plan."""
    return [(rows, ds.build(epoch, rows, g)) for g, rows in enumerate(ds.plan(epoch).batches)]


def row_layout(ds, rows):
    """Per row: [(sample id, context start, length T)] in packing order, as build() lays them out
    (samples back to back from 0), derived from the plan's rows and the store, not from the batch."""
    S_max = ds.spec.s_shapes[-1]
    out = []
    for row in rows:
        c0, items = 0, []
        for i in row:
            sid = int(ds.sample_ids[int(i)])
            T = min(len(ds.store.samples[sid]["input_ids"]), S_max)
            items.append((sid, c0, T))
            c0 += T
        out.append(items)
    return out


# ---------------------------------------------------------------------------------------------------
# 1. anchors


def brute_eligible(lm: np.ndarray) -> list[int]:
    T = len(lm)
    return [a for a in range(T) if a + 1 < T and lm[a] and lm[a + 1]]


def test_eligible_anchors_match_the_definition():
    rng = np.random.default_rng(5)
    cases = [np.zeros(0, bool), np.ones(1, bool), np.array([1, 1], bool), np.array([1, 0, 1], bool),
             np.array([0, 1, 1, 1, 0, 1, 1], bool), np.ones(9, bool)]
    cases += [rng.random(int(rng.integers(1, 60))) < p for p in (0.2, 0.5, 0.8, 0.95) for _ in range(10)]
    for lm in cases:
        assert L.eligible_anchors(lm).tolist() == brute_eligible(lm), lm.astype(int).tolist()
    # the last token is never an anchor, however supervised
    assert L.eligible_anchors(np.ones(9, bool)).tolist() == list(range(8))


def test_draw_anchors_distinct_sorted_eligible_and_seeded():
    for sid, s in SAMPLES.items():
        lm = s["loss_mask"]
        elig = set(brute_eligible(lm))
        for n in (1, 3, 5, 1000):
            a = L.draw_anchors(lm, n, seed=11, epoch=2, sample_id=sid)
            assert len(a) == min(n, len(elig))  # as many as asked, or every eligible position
            assert np.all(np.diff(a) > 0)  # distinct and sorted
            assert set(a.tolist()) <= elig
            assert np.array_equal(a, L.draw_anchors(lm.copy(), n, seed=11, epoch=2, sample_id=sid))
        if len(elig) > 8:  # a real choice: seed, epoch and sample id each change it
            a = L.draw_anchors(lm, 4, 11, 2, sid)
            assert not np.array_equal(a, L.draw_anchors(lm, 4, 12, 2, sid))
            assert not np.array_equal(a, L.draw_anchors(lm, 4, 11, 3, sid))
            assert not np.array_equal(a, L.draw_anchors(lm, 4, 11, 2, sid + 1))


def test_draw_anchors_is_uniform_over_eligible_positions():
    """Over many epochs each eligible position is drawn about equally often (k/n of the epochs)."""
    lm = np.zeros(60, bool)
    lm[10:] = True
    lm[[20, 33, 34, 50]] = False
    elig = brute_eligible(lm)
    epochs, k = 3000, 6
    counts = np.zeros(len(lm))
    for e in range(epochs):
        counts[L.draw_anchors(lm, k, 0, e, 7)] += 1
    p = k / len(elig)
    expect, sd = epochs * p, math.sqrt(epochs * p * (1 - p))
    assert counts[[a for a in range(len(lm)) if a not in elig]].sum() == 0
    assert np.abs(counts[elig] - expect).max() < 5 * sd


def test_batch_anchors_are_the_samples_own_draw_whatever_the_packing():
    """In every micro-batch, the blocks of sample `sid` have exactly the anchors
    draw_anchors(loss_mask, cap, seed, epoch, sid): the same set in every packing and alone in a row."""
    layouts = [dict(rows_per_batch=1, token_budget=128), dict(rows_per_batch=3, token_budget=256),
               dict(rows_per_batch=2, token_budget=512, block_budget=256)]
    for epoch in (0, 1):
        seen = []
        for kw in layouts:
            ds = dataset(**kw)
            got = {}
            for rows, b in built(ds, epoch):
                for r, items in enumerate(row_layout(ds, rows)):
                    for j, (sid, _c0, _T) in enumerate(items):
                        sel = b.mask["q_sample"][r] == j
                        anchors = sorted(set(b.mask["q_anchor"][r][sel].tolist()))
                        assert sid not in got
                        got[sid] = anchors
            for sid, s in SAMPLES.items():
                expect = L.draw_anchors(s["loss_mask"], 5, 11, epoch, sid).tolist()
                assert got.get(sid, []) == expect, (kw, sid)
            seen.append(got)
        assert seen[0] == seen[1] == seen[2]
        # alone in a row: the same draw
        ds = dataset(rows_per_batch=1)
        for idx, sid in enumerate(ds.sample_ids.tolist()):
            b = ds.build(epoch, [np.array([idx])])
            assert b.block_positions[0, : len(seen[0][sid]) * B : B].tolist() == seen[0][sid]


# ---------------------------------------------------------------------------------------------------
# 2-4. labels, inputs, weights and positions of every block slot, from the definitions


def expected_slot(s: dict, a: int, k: int, w: np.ndarray):
    """(input id, label, weight, position) of block position k of the block anchored at a."""
    ids, lm = s["input_ids"], s["loss_mask"]
    T = len(ids)
    inp = int(ids[a]) if k == 0 else MASK_ID
    if k >= 1 and a + k < T and lm[a + k]:
        return inp, int(ids[a + k]), float(w[k]), a + k
    return inp, IGNORE, 0.0, a + k


@pytest.mark.parametrize("block_size,gamma", [(4, None), (16, None), (10, 2.5), (8, None)])
def test_every_block_slot_follows_the_definition(block_size, gamma):
    ds = dataset(block_size=block_size, gamma=gamma, num_anchors=4, token_budget=256, block_budget=256)
    w = np.array([0.0] + [math.exp(-(k - 1) / (gamma or default_gamma(block_size))) for k in range(1, block_size)])
    n_labels = 0
    for rows, b in built(ds):
        Q = b.labels.shape[1]
        for r, items in enumerate(row_layout(ds, rows)):
            q = 0
            for _j, (sid, _c0, _T) in enumerate(items):
                s = ds.store.samples[sid]
                for a in L.draw_anchors(s["loss_mask"], 4, ds.spec.seed, 0, sid).tolist():
                    for k in range(block_size):
                        inp, lab, wt, pos = expected_slot(s, a, k, w)
                        assert int(b.block_input_ids[r, q]) == inp
                        assert int(b.labels[r, q]) == lab, (sid, a, k)
                        assert float(b.loss_weight[r, q]) == pytest.approx(wt, rel=1e-6)
                        assert int(b.block_positions[r, q]) == pos  # anchor + k, own coordinates
                        assert int(b.block_pos_in_block[r, q]) == k
                        n_labels += lab != IGNORE
                        q += 1
            # padding slots: nothing to learn, no weight
            assert (b.labels[r, q:] == IGNORE).all() and (b.loss_weight[r, q:] == 0).all()
            assert q <= Q
        assert b.loss_weight_sum == pytest.approx(float(b.loss_weight.double().sum()))
        assert torch.equal(b.label_index, (b.labels.reshape(-1) != IGNORE).nonzero().squeeze(1))
    assert n_labels > 50


def test_anchor_position_is_never_labelled_and_labels_are_real_tokens():
    """k = 0 carries the anchor's own token as input and no label; a label is the token at a + k."""
    ds = dataset(num_anchors=50, token_budget=512, block_budget=512)
    for rows, b in built(ds):
        k = b.block_pos_in_block
        assert (b.labels[k == 0] == IGNORE).all() and (b.loss_weight[k == 0] == 0).all()
        assert (b.block_input_ids[k > 0] == MASK_ID).all()  # no later token leaks into the block
        for r, items in enumerate(row_layout(ds, rows)):
            for j, (sid, _c0, T) in enumerate(items):
                s = ds.store.samples[sid]
                sel = (b.mask["q_sample"][r] == j).numpy()
                pos = b.block_positions[r].numpy()[sel]
                lab = b.labels[r].numpy()[sel]
                ok = lab != IGNORE
                assert (pos[ok] < T).all() and s["loss_mask"][pos[ok]].all()
                assert np.array_equal(lab[ok], s["input_ids"][pos[ok]])
                # and every supervised in-sample position k >= 1 of a block is labelled
                kk = b.block_pos_in_block[r].numpy()[sel]
                should = (kk >= 1) & (pos < T) & s["loss_mask"][np.minimum(pos, T - 1)]
                assert np.array_equal(ok, should)


def test_position_weights_and_default_gammas():
    assert default_gamma(16) == 7 and default_gamma(10) == 5 and default_gamma(8) == 4
    for Bs, g in ((16, 7.0), (10, 5.0), (8, 4.0)):
        w = position_weights(Bs)
        assert w.dtype == torch.float32 and w.shape == (Bs,)
        assert float(w[0]) == 0.0 and float(w[1]) == 1.0
        for k in range(1, Bs):
            assert float(w[k]) == pytest.approx(math.exp(-(k - 1) / g), rel=1e-6)
        assert torch.all(w[2:] < w[1:-1])  # strictly decaying after position 1
    w = position_weights(16, gamma=3.0)
    assert float(w[4]) == pytest.approx(math.exp(-1.0), rel=1e-6)


def test_context_positions_restart_for_every_packed_sample():
    ds = dataset(rows_per_batch=2, token_budget=256, block_budget=256)
    multi = 0
    for rows, b in built(ds):
        S = b.ctx_positions.shape[1]
        for r, items in enumerate(row_layout(ds, rows)):
            multi += len(items) > 1
            end = 0
            for j, (sid, c0, T) in enumerate(items):
                s = ds.store.samples[sid]
                assert b.ctx_positions[r, c0 : c0 + T].tolist() == list(range(T))
                assert b.mask["kv_pos"][r, c0 : c0 + T].tolist() == list(range(T))
                assert (b.mask["kv_sample"][r, c0 : c0 + T] == j).all()
                assert torch.equal(b.ctx_hidden[r, c0 : c0 + T], torch.from_numpy(s["hidden"]))
                end = c0 + T
            assert (b.ctx_hidden[r, end:S] == 0).all() and (b.mask["kv_sample"][r, end:S] == -1).all()
    assert multi >= 3  # several samples did share rows


# ---------------------------------------------------------------------------------------------------
# 5. masks in packed rows, against the definition


def mask_by_definition(items, blocks, Bs, S, Q) -> torch.Tensor:
    """items: [(context start, length)] of a row's samples; blocks: [(sample j, anchor)] in slot order.
    Query slot q of block i sees context keys of its own sample at positions < a_i and the B keys of
    its own block, nothing else."""
    m = torch.zeros(Q, S + Q, dtype=torch.bool)
    for i, (j, a) in enumerate(blocks):
        c0, T = items[j]
        for q in range(i * Bs, (i + 1) * Bs):
            for t in range(T):
                if t < a:
                    m[q, c0 + t] = True
            for kq in range(i * Bs, (i + 1) * Bs):
                m[q, S + kq] = True
    return m


def test_packed_batch_masks_match_the_definition():
    for kw in (dict(rows_per_batch=2, token_budget=256, block_budget=128),
               dict(rows_per_batch=1, token_budget=384, block_budget=256, block_size=10, num_anchors=7)):
        ds = dataset(**kw)
        Bs = ds.spec.block_size
        for rows, b in built(ds)[:3]:
            R, S = b.ctx_positions.shape
            Q = b.labels.shape[1]
            dense = masks.to_dense_mask(b.mask)[:, 0]
            flex = masks.block_mask_to_dense(masks.to_block_mask(b.mask))[:, 0]  # what the GPU applies
            for r, items in enumerate(row_layout(ds, rows)):
                blocks = [(j, a) for j, (sid, c0, T) in enumerate(items)
                          for a in L.draw_anchors(ds.store.samples[sid]["loss_mask"], ds.spec.max_blocks,
                                                  ds.spec.seed, 0, sid).tolist()]
                ref = mask_by_definition([(c0, T) for _, c0, T in items], blocks, Bs, S, Q)
                assert torch.equal(dense[r], ref)
                assert torch.equal(flex[r], ref)
            for r in range(len(rows), R):  # rows the last micro-batch lacks see nothing
                assert not dense[r].any()


@pytest.mark.parametrize("Bs", [3, 8, 16, 64, 128, 160])
def test_mask_metadata_edge_layouts(Bs):
    """Samples and blocks on tile boundaries, anchors 0 and len-1 (allowed: len), blocks filling Q,
    samples filling S: the descriptors' mask and flex's tile view both equal the definition."""
    rng = np.random.default_rng(Bs)
    S = 384
    lens = [128, 1, 127, 128]  # fills S exactly, boundaries on and off tiles
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).tolist()
    nb_max = 512 // Bs
    blocks = []
    for j, T in enumerate(lens):
        for a in sorted({0, T - 1, T // 2, min(T - 1, 127)}):
            blocks.append((j, a))
    while len(blocks) < nb_max:
        j = int(rng.integers(0, len(lens)))
        blocks.append((j, int(rng.integers(0, lens[j]))))
    blocks = blocks[:nb_max]
    Q = -(-len(blocks) * Bs // 128) * 128
    meta = masks.mask_metadata(starts, lens, [j for j, _ in blocks], [a for _, a in blocks], Bs, S, Q)
    ref = mask_by_definition(list(zip(starts, lens)), blocks, Bs, S, Q)
    assert torch.equal(masks.dense_mask(meta), ref)
    assert torch.equal(masks.block_mask_to_dense(masks.to_block_mask(meta))[0, 0], ref)


# ---------------------------------------------------------------------------------------------------
# 6. packing invariance of each sample's contribution, through a tiny drafter


def tiny_drafter(Bs=B, seed=0):
    cfg = DrafterConfig(hidden_size=H, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=8, intermediate_size=32, vocab_size=V, num_target_layers=4,
                        target_layer_ids=[1, 2], mask_token_id=MASK_ID, block_size=Bs, rope_theta=10000.0)
    torch.manual_seed(seed)
    model = DFlashDrafter(cfg).double()
    for p in model.parameters():  # norms away from 1, so that no layer is an identity
        with torch.no_grad():
            p.add_(0.05 * torch.randn_like(p))
    g = torch.Generator().manual_seed(seed + 1)
    embed = torch.randn(V, H, generator=g, dtype=torch.float64)
    head = torch.randn(V, H, generator=g, dtype=torch.float64)
    return model, embed, head


def forward(model, embed, b):
    emb = torch.nn.functional.embedding(b.block_input_ids, embed)
    return model(b.ctx_hidden, emb, b.ctx_positions, b.block_positions, masks.to_dense_mask(b.mask))


def contributions(ds, model, embed, head, epoch=0, batches=None):
    """({(sid, anchor, k): (label, weight, position, drafter output [H], w * ce)}, summed gradient of
    sum(w * ce) over the epoch's micro-batches) -- the sample-level view of one epoch's training."""
    model.zero_grad(set_to_none=True)
    per = {}
    for rows, b in batches if batches is not None else built(ds, epoch):
        hidden = forward(model, embed, b)
        out = block_loss(hidden, head, b.labels, b.loss_weight, block_size=ds.spec.block_size, denom=1.0,
                         label_index=b.label_index, chunk=37)
        out.loss.backward()
        with torch.no_grad():
            logits = hidden @ head.t()
            ce = torch.logsumexp(logits, -1) - logits.gather(-1, b.labels.clamp_min(0)[..., None])[..., 0]
        for r, items in enumerate(row_layout(ds, rows)):
            for j, (sid, _c0, _T) in enumerate(items):
                for q in torch.nonzero(b.mask["q_sample"][r] == j).flatten().tolist():
                    a, k = int(b.mask["q_anchor"][r, q]), int(b.block_pos_in_block[r, q])
                    lab, wt = int(b.labels[r, q]), float(b.loss_weight[r, q])
                    key = (sid, a, k)
                    assert key not in per  # each (sample, anchor) block once per epoch
                    per[key] = (lab, wt, int(b.block_positions[r, q]), hidden[r, q].detach().clone(),
                                wt * float(ce[r, q]) if lab != IGNORE else 0.0)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return per, grads


def assert_same_contributions(x, y):
    (pa, ga), (pb, gb) = x, y
    assert pa.keys() == pb.keys()
    for key in pa:
        la, wa, qa, ha, ca = pa[key]
        lb, wb, qb, hb, cb = pb[key]
        assert (la, qa) == (lb, qb) and wa == pytest.approx(wb), key
        torch.testing.assert_close(ha, hb, rtol=1e-10, atol=1e-10, msg=lambda m, key=key: f"{key}: {m}")
        assert ca == pytest.approx(cb, rel=1e-9, abs=1e-12), key
    for n in ga:
        # block_loss takes the softmax in float32 (by design): 1e-6, not float64's 1e-12
        torch.testing.assert_close(ga[n], gb[n], rtol=1e-6, atol=1e-9, msg=lambda m, n=n: f"{n}: {m}")


PACKINGS = [
    dict(rows_per_batch=1, token_budget=128, block_budget=128),
    dict(rows_per_batch=3, token_budget=256, block_budget=128),
    dict(rows_per_batch=2, token_budget=512, block_budget=384),
    dict(rows_per_batch=4, token_budget=1024, block_budget=1024, num_shapes=1),
]


@pytest.mark.parametrize("Bs", [4, 10])
def test_contribution_does_not_depend_on_packing(Bs):
    """Each sample alone in a row, then four packings (other rows_per_batch, token and block budgets,
    row-mates, padded shapes): the same blocks, labels, weights, drafter outputs, loss terms and summed
    gradient."""
    model, embed, head = tiny_drafter(Bs)
    alone_ds = dataset(rows_per_batch=1, block_size=Bs)
    alone = [([np.array([i])], alone_ds.build(0, [np.array([i])])) for i in range(len(alone_ds.sample_ids))]
    ref = contributions(alone_ds, model, embed, head, batches=alone)
    assert len(ref[0]) > 100 and sum(c for *_, c in ref[0].values()) > 0
    shapes, shared = set(), 0
    for kw in PACKINGS:
        ds = dataset(**kw, block_size=Bs)
        bs = built(ds)
        shapes |= {tuple(b.labels.shape) + (b.ctx_positions.shape[1],) for _, b in bs}
        shared += sum(len(row) > 1 for rows, _ in bs for row in rows)
        assert_same_contributions(ref, contributions(ds, model, embed, head, batches=bs))
    assert len(shapes) >= 4 and shared >= 4  # the packings really differ in shapes and row-mates


def test_contribution_does_not_depend_on_micro_batch_grouping():
    """The same rows regrouped into micro-batches of other sizes (and in another order): the same sum."""
    model, embed, head = tiny_drafter()
    ds = dataset(rows_per_batch=1, token_budget=256)
    rows = [r for batch in ds.plan(0).batches for r in batch]
    ref = contributions(ds, model, embed, head, batches=[([r], ds.build(0, [r])) for r in rows])
    wide = dataset(rows_per_batch=3, token_budget=256)
    perm = np.random.default_rng(0).permutation(len(rows))
    groups = [[rows[i] for i in perm[g : g + 3]] for g in range(0, len(rows), 3)]
    assert_same_contributions(ref, contributions(wide, model, embed, head,
                                                 batches=[(gr, wide.build(0, gr)) for gr in groups]))


def test_truncation_is_the_exception_a_long_sample_is_cut_to_the_row():
    """A sample longer than round_up(token_budget) is cut to it: no anchor at or past the cut, and a label
    past it is ignored although the token exists and is supervised (its contribution depends on
    token_budget, unlike everything above)."""
    T = 300
    s = dict(input_ids=np.arange(T) % (V - 1), loss_mask=np.ones(T, bool),
             hidden=np.random.default_rng(0).standard_normal((T, NL * H)))
    ds = dataset({5: s}, token_budget=128, num_anchors=200, block_budget=1024, rows_per_batch=1)
    b = ds.build(0, ds.plan(0).batches[0][:1])
    S = ds.spec.s_shapes[-1]
    real = b.mask["q_sample"][0] >= 0  # padding slots at the end of the block stream are not blocks
    anchors = b.block_positions[0, real & (b.block_pos_in_block[0] == 0)]
    n = len(anchors)
    assert n == S - 1 and anchors.max() == S - 2  # every eligible position of the cut sample
    pos, lab = b.block_positions[0, : n * B], b.labels[0, : n * B]
    assert (lab[pos >= S] == IGNORE).all() and (lab[(pos < S) & (b.block_pos_in_block[0, : n * B] > 0)] != IGNORE).all()
    full = dataset({5: s}, token_budget=512, num_anchors=200, block_budget=1024, rows_per_batch=1)
    assert len(full.build(0, full.plan(0).batches[0][:1]).block_positions[0].unique()) > S


def test_block_budget_caps_blocks_per_sample_not_per_row():
    """max_blocks = min(num_anchors, round_up(block_budget) // B) caps every sample alike: a sample's
    block count is min(#eligible, num_anchors, round_up(block_budget) // B), whoever shares its row,
    whatever rows_per_batch and token_budget are; and its anchors are the draw of that many."""
    samples = make_samples(n=10, min_len=150, max_len=250, seed=3)  # many eligible anchors each
    for Bs, budget, n_anchors in ((16, 128, 64), (8, 200, 30), (16, 512, 64)):
        cap = min(n_anchors, L.round_up(budget) // Bs)
        counts = []
        for kw in (dict(rows_per_batch=1, token_budget=256), dict(rows_per_batch=3, token_budget=1024)):
            ds = dataset(samples, block_size=Bs, num_anchors=n_anchors, block_budget=budget, **kw)
            assert ds.spec.max_blocks == cap
            got = {}
            for rows, b in built(ds):
                for r, items in enumerate(row_layout(ds, rows)):
                    for j, (sid, _c0, _T) in enumerate(items):
                        got[sid] = sorted(set(b.mask["q_anchor"][r][b.mask["q_sample"][r] == j].tolist()))
            for sid, s in samples.items():
                n_elig = len(brute_eligible(s["loss_mask"]))
                assert len(got[sid]) == min(n_elig, n_anchors, L.round_up(budget) // Bs)
                assert got[sid] == L.draw_anchors(s["loss_mask"], cap, ds.spec.seed, 0, sid).tolist()
            counts.append(got)
        assert counts[0] == counts[1]


# ---------------------------------------------------------------------------------------------------
# 7. loss normalisation across rows, micro-batches and processes


def test_step_gradient_equals_one_big_batch():
    """W processes x A accumulation steps, each micro-batch's loss divided by the step's global weight
    sum / W and the processes' gradients averaged (as DDP does): the gradient of one batch holding all
    the step's rows, normalised by its own weight sum, and the full-logits reference."""
    W, A = 2, 3
    model, embed, head = tiny_drafter(seed=4)
    ds = dataset(rows_per_batch=1, token_budget=128, balance_group=W * A)
    assert len(ds.plan(0)) >= W * A
    step = ds.plan(0).batches[: W * A]
    micro = [ds.build(0, rows, g) for g, rows in enumerate(step)]
    denom = sum(b.loss_weight_sum for b in micro)  # what the trainer all-reduces
    sums = [b.loss_weight_sum for b in micro]
    assert max(sums) > 1.3 * min(sums)  # the micro-batches differ in weight: normalisation matters

    def grads_of(loss_fn):
        model.zero_grad(set_to_none=True)
        loss_fn()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()])

    def per_process():
        per_rank = []
        for w in range(W):
            model.zero_grad(set_to_none=True)
            for a in range(A):
                b = micro[a * W + w]  # RankSampler: micro-batch g + a * W + rank
                out = block_loss(forward(model, embed, b), head, b.labels, b.loss_weight, block_size=B,
                                 denom=denom / W, label_index=b.label_index, chunk=29)
                out.loss.backward()
                assert float(out.weight_sum) == pytest.approx(b.loss_weight_sum, rel=1e-6)
            per_rank.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        return torch.stack(per_rank).mean(0)  # DDP's average

    g_step = per_process()
    big_ds = dataset(rows_per_batch=W * A, token_budget=128)
    big = big_ds.build(0, [r for rows in step for r in rows])
    assert big.loss_weight_sum == pytest.approx(denom)
    g_big = grads_of(lambda: block_loss(forward(model, embed, big), head, big.labels, big.loss_weight,
                                        block_size=B, denom=big.loss_weight_sum).loss.backward())
    g_ref = grads_of(lambda: reference_block_loss(forward(model, embed, big), head, big.labels,
                                                  big.loss_weight, big.loss_weight_sum).backward())
    torch.testing.assert_close(g_step, g_big, rtol=1e-6, atol=1e-10)
    # the reference takes its softmax in float64, block_loss in float32
    torch.testing.assert_close(g_big, g_ref, rtol=1e-3, atol=1e-6)
    # the loss is the weighted mean: sum(w * ce) / sum(w) over every label of the step
    with torch.no_grad():
        hb = forward(model, embed, big)
        logits = hb @ head.t()
        y = big.labels
        ce = torch.logsumexp(logits, -1) - logits.gather(-1, y.clamp_min(0)[..., None])[..., 0]
        w = big.loss_weight.double()
        mean = float((w * ce * (y != IGNORE)).sum() / w.sum())
        out = block_loss(hb, head, y, big.loss_weight, block_size=B, denom=big.loss_weight_sum)
    assert float(out.loss) == pytest.approx(mean, rel=1e-6)  # float32 softmax

    # per-micro-batch normalisation (each micro-batch its own mean, then averaged) is another objective:
    # it weights a label by 1 / (its micro-batch's weight sum); only the global denominator is invariant
    model.zero_grad(set_to_none=True)
    for b in micro:
        block_loss(forward(model, embed, b), head, b.labels, b.loss_weight, block_size=B,
                   denom=b.loss_weight_sum * len(micro)).loss.backward()
    g_local = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert not torch.allclose(g_local, g_big, rtol=1e-3)


class _Plans:
    """The epoch plans of a store's index (what PackedDataset.plan returns), for RankSampler."""

    def __init__(self, lengths, max_blocks, spec):
        self.lengths, self.max_blocks, self.spec, self.cache = lengths, max_blocks, spec, {}

    def plan(self, epoch):
        if epoch not in self.cache:
            self.cache[epoch] = L.plan_epoch(self.lengths, self.max_blocks, self.spec, epoch)
        return self.cache[epoch]


@pytest.mark.parametrize("balance", [False, True])
def test_epoch_tail_left_out_is_not_always_the_same_samples(balance):
    """W processes x A accumulation: the sampler leaves out the n % (W*A) micro-batches of an epoch's
    tail.  Which samples they hold must change from epoch to epoch; with balance_group = W*A the plan
    once put the cheapest micro-batches there, the store's shortest samples in every epoch, which were
    then never trained at all."""
    W, A, epochs = 3, 1, 16
    rng = np.random.default_rng(0)
    n = 600
    lengths = np.clip(rng.lognormal(np.log(400), 0.8, n), 20, 4096).astype(np.int64)
    max_blocks = np.minimum(lengths // 2 - 1, 64)
    sp = L.LoaderSpec(block_size=16, num_anchors=64, token_budget=4096, block_budget=4096, rows_per_batch=1,
                      mask_token_id=0, balance_group=W * A if balance else 1)
    plans = _Plans(lengths, max_blocks, sp)
    steps = sum(len(plans.plan(e)) // (W * A) for e in range(epochs))
    assert sum(len(plans.plan(e)) % (W * A) for e in range(epochs)) >= epochs  # tails to leave out
    trained = {e: set() for e in range(epochs)}
    for r in range(W):
        for e, g in L.RankSampler(plans, r, W, A, 0, 0, steps):
            trained[e].update(int(i) for row in plans.plan(e).batches[g] for i in row)
    left_out = np.zeros(n, dtype=np.int64)
    for e in range(epochs):
        everyone = {int(i) for b in plans.plan(e).batches for row in b for i in row}
        assert everyone == set(range(n))
        left_out[list(everyone - trained[e])] += 1
    assert left_out.sum() > 0
    assert left_out.max() <= epochs // 4, np.sort(lengths[left_out > epochs // 4])[:10]
