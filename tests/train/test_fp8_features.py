"""fp8 stores: context features travel as e4m3 bits + scales and are dequantised where the step runs.

The loader reads the stored bits straight into the packed batch (no dequantising in the worker); the
DeviceFeeder (training) and offline_tau dequantise on the device.  What a drafter sees must be exactly what
Store.read gives, so a run on an fp8 store equals a run on a bf16 store holding those same values."""

import json
import shutil

import numpy as np
import pytest
import torch

from dflash.train import loader as L

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fp8_store(tmp_path_factory):
    from train_fixtures import build_counting_store

    return build_counting_store(tmp_path_factory.mktemp("fp8"), n=24, teach=False, hidden_dtype="fp8")


def _spec(**kw):
    base = dict(block_size=8, num_anchors=4, token_budget=256, block_budget=128, rows_per_batch=2, mask_token_id=7)
    return L.LoaderSpec(**{**base, **kw})


def _check_rows(b, store, S_max):
    """Each packed sample's dequantised features equal Store.read's; padding is zero bits and zero scale."""
    from dflash.store.rows import dequantise_fp8

    feats = dequantise_fp8(b.ctx_hidden, b.ctx_scale)
    c0, r = 0, 0
    for sid in b.sample_ids.tolist():
        h = store.read(sid)["hidden"]
        T = min(len(h), S_max)
        if c0 + T > b.ctx_hidden.shape[1]:
            assert (b.ctx_hidden[r, c0:] == 0).all() and (b.ctx_scale[r, c0:] == 0).all()
            r, c0 = r + 1, 0
        assert torch.equal(feats[r, c0 : c0 + T], h[:T]), sid
        c0 += T
    assert (b.ctx_hidden[r, c0:] == 0).all() and (b.ctx_scale[r, c0:] == 0).all()


def test_batches_carry_fp8_bits_that_dequantise_to_the_store(fp8_store):
    from dflash.store import open_store

    store = open_store(fp8_store[1])
    spec = _spec()
    ds = L.PackedDataset(store, spec)
    for g in range(len(ds.plan(0))):
        b = ds[(0, g)]
        assert b.ctx_hidden.dtype == torch.uint8 and b.ctx_scale.dtype == torch.float32
        assert b.ctx_scale.shape == (*b.ctx_hidden.shape[:2], store.num_layers)
        _check_rows(b, store, spec.s_shapes[-1])
        d = b.dequantised()
        assert d.ctx_hidden.dtype == torch.bfloat16 and d.ctx_scale is None and d.dequantised() is d
        assert torch.equal(d.labels, b.labels)


def test_workers_and_slots_hand_the_step_bf16_features(fp8_store):
    """Through forkserver workers writing bits into shared batch slots (2 slots: each reused) and the
    DeviceFeeder, every micro-batch reaches the step dequantised, equal to the in-process batch."""
    from dflash.store import open_store
    from dflash.train.batch_slots import BatchSlots
    from dflash.train.feeder import DeviceFeeder

    store = open_store(fp8_store[1])
    spec = _spec()
    ds = L.PackedDataset(store, spec)
    steps = 2 * len(ds.plan(0))
    slots = BatchSlots(2, L.batch_bytes(spec, store.hidden_size * store.num_layers))
    loader = L.make_loader(ds, L.RankSampler(ds, 0, 1, 1, 0, 0, steps), num_workers=2, slots=slots)
    feeder = DeviceFeeder(loader, torch.device("cpu"), per_step=1, slots=slots)
    seen = 0
    try:
        while True:
            try:
                (item,) = feeder.take()
            except StopIteration:
                break
            b = feeder.ready(item)
            ref = ds[(b.epoch, b.index)].dequantised()
            assert b.ctx_hidden.dtype == torch.bfloat16 and b.ctx_scale is None
            assert torch.equal(b.ctx_hidden, ref.ctx_hidden) and torch.equal(b.labels, ref.labels)
            seen += 1
    finally:
        feeder.close()
    assert seen == steps


def test_drafter_refuses_fp8_bits(fp8_store):
    """Bits fed as numbers would train on garbage without a sound: the drafter refuses them."""
    from dflash.drafter import DFlashDrafter, DrafterConfig
    from dflash.store import open_store

    store = open_store(fp8_store[1])
    b = L.PackedDataset(store, _spec())[(0, 0)]
    cfg = DrafterConfig(hidden_size=store.hidden_size, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=store.hidden_size // 2, intermediate_size=32,
                        vocab_size=64, num_target_layers=4, target_layer_ids=store.target_layer_ids,
                        mask_token_id=7, block_size=8)
    m = DFlashDrafter(cfg)
    embeds = torch.zeros(*b.block_input_ids.shape, store.hidden_size)
    with pytest.raises(ValueError, match="fp8 store holds e4m3 bits"):
        m(b.ctx_hidden, embeds, b.ctx_positions, b.block_positions, None)


def _bf16_twin(src, dst):
    """A bf16 store holding exactly the values the fp8 store at `src` dequantises to (same ids, masks, top-k)."""
    from dflash.store import ShardWriter, create_or_check_manifest, open_store

    s = open_store(src)
    manifest = json.loads((src / "manifest.json").read_text())
    manifest = {k: v for k, v in manifest.items() if k not in ("shards",)}
    manifest.update(hidden_dtype="bf16", num_shards=1)
    create_or_check_manifest(dst, manifest, overwrite=True)
    with ShardWriter(dst, 0, hidden_width=s.hidden_size * s.num_layers, num_layers=s.num_layers,
                     hidden_dtype="bf16", topk=s.topk, durable=False) as w:
        for sid in s.sample_ids():
            d = s.read(sid)
            w.append(sid, sid, d["input_ids"], d["loss_mask"].to(torch.uint8), d["hidden"], d["topk_ids"],
                     d["topk_logprobs"])
        w.finalize({})
    return dst


def test_training_on_fp8_equals_training_on_its_values(fp8_store, tmp_path):
    """The whole trainer (workers, slots, feeder, step) on the fp8 store gives the same losses, step for step,
    as on a bf16 store of the dequantised values: the bits reach the drafter as Store.read's values."""
    from dflash.config import TrainConfig
    from dflash.train.launch import launch_train

    target, src = fp8_store
    twin = _bf16_twin(src, tmp_path / "bf16_store")
    losses = {}
    for name, store in (("fp8", src), ("bf16", twin)):
        cfg = TrainConfig(store=str(store), target=str(target), out=str(tmp_path / f"run_{name}"), gpus="cpu:1",
                          block_size=8, num_layers=1, steps=4, lr=3e-3, warmup_steps=1, token_budget=256,
                          num_anchors=8, num_workers=1, compile="off", seed=0, save_every=0)
        launch_train(cfg)
        recs = [json.loads(x) for x in (tmp_path / f"run_{name}" / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [r["loss"] for r in recs]
    assert len(losses["fp8"]) == 4 and np.isfinite(losses["fp8"]).all()
    assert losses["fp8"] == losses["bf16"]
    # held-out tau reads fp8 bits too (dequantised where the drafter runs): the twin gives the same
    from dflash.evaluate.export import load_training_drafter
    from dflash.store import open_store
    from dflash.target_model.files import load_embed_and_head
    from dflash.train.heldout import offline_tau

    drafter = load_training_drafter(tmp_path / "run_fp8")[0]
    embed, head = load_embed_and_head(target)
    taus = [offline_tau(drafter, embed, head, open_store(st), num_anchors=8, progress=False) for st in (src, twin)]
    assert taus[0]["num_blocks"] > 0 and taus[0]["tau"] == taus[1]["tau"] and taus[0]["acceptance"] == taus[1]["acceptance"]
    shutil.rmtree(twin)
