"""`dflash precompute --final-hidden`: the target's last hidden state (pre-norm) in its own array, exact
against a direct forward, fp8 within its quantisation error, checked by verify and on read, kept by
--append, refused where missing; a store made without it is as before."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.compute as pc
import pytest
import torch
from click.testing import CliRunner

from dflash.chat import conversation_of, load_rows, render
from dflash.cli import main
from dflash.drafter.dspark.family import require_final_hidden
from dflash.errors import DamagedSampleError, StoreError
from dflash.store import open_store, verify_store
from dflash.store.parts import part_path
from dflash.target_model.capture import Capture, load_target, load_tokenizer
from helpers import build_store, make_conversations_jsonl, make_tiny_target

SHARD = "shard-00000"
OPTS = dict(commit_every_tokens=200, store_chunk_tokens=16)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """One target and dataset; stores with and without the final hidden state, bf16 and fp8."""
    d = tmp_path_factory.mktemp("final_hidden")
    target = make_tiny_target(d, arch="qwen3")
    data = make_conversations_jsonl(d / "d.jsonl", 8, seed=5)
    # token_budget 1: every sample is a batch of its own, so the capture is the unpadded forward, bit for bit
    return dict(dir=d, target=target, data=data,
                plain=build_store(d / "plain", target, data, token_budget=1, **OPTS),
                bf16=build_store(d / "bf16", target, data, final_hidden=True, token_budget=1, **OPTS),
                fp8=build_store(d / "fp8", target, data, final_hidden=True, hidden_dtype="fp8", writer="thread", **OPTS))


def _direct(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the last decoder layer's output, transformers' hidden_states[-1]) of a plain forward of `ids`."""
    seen = {}
    hook = model.model.layers[-1].register_forward_hook(lambda _m, _a, out: seen.update(h=out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():
            ref = model(torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    finally:
        hook.remove()
    return seen["h"][0], ref.hidden_states[-1][0]


def test_final_hidden_is_the_last_layer_before_the_norm(made):
    s = open_store(made["bf16"])
    assert s.manifest["final_hidden"] is True and verify_store(made["bf16"]).ok
    model = load_target(made["target"], torch.float32, torch.device("cpu"))
    tok, ds = load_tokenizer(made["target"]), load_rows(made["data"])
    head, norm = model.get_output_embeddings(), model.model.norm
    for sid in s.sample_ids():
        got = s.read(sid)
        ids = render(tok, conversation_of(ds[sid], sid, made["data"]), 256).input_ids
        pre, post = _direct(model, ids)
        assert got["final_hidden"].dtype == torch.bfloat16 and got["final_hidden"].shape == (len(ids), s.hidden_size)
        assert torch.equal(got["final_hidden"], pre.to(torch.bfloat16))  # same ids, same fp32 forward: exact
        assert not torch.allclose(pre, post)  # what is stored is not transformers' normed hidden_states[-1]
        with torch.no_grad():  # what a trainer does with it: the target's distribution, up to bf16 rounding
            logits = head(norm(got["final_hidden"].float()))
        top = logits.topk(s.topk, dim=-1).indices
        assert (top[:, 0] == got["topk_ids"][:, 0]).float().mean() >= 0.95
        assert (top == got["topk_ids"]).float().mean() >= 0.9


@pytest.mark.parametrize("topk", [0, 4])
def test_capture_of_the_last_layer_normed_and_not(made, topk):
    """A captured last layer is normed (transformers' hidden_states[-1]); the final hidden state is not, and
    with top-k off the forward still runs to the last layer for it."""
    model = load_target(made["target"], torch.float32, torch.device("cpu"))
    ids = list(range(5, 30))
    pre, post = _direct(model, ids)
    out = Capture(model, [1, 3], topk=topk, compile="off", final_hidden=True)(torch.tensor([ids]))
    H = pre.shape[-1]
    assert torch.equal(out["final_hidden"][0], pre) and torch.equal(out["hidden"][0, :, H:], post)
    assert ("topk_ids" in out) == bool(topk)
    assert "final_hidden" not in Capture(model, [1], topk=topk, compile="off")(torch.tensor([ids]))


def test_final_hidden_leaves_the_other_arrays_as_they_were(made):
    plain = open_store(made["plain"])
    assert "final_hidden" not in plain.manifest and not plain.final_hidden
    assert not (made["plain"] / SHARD / "final_hidden").exists()
    assert "final_hidden" not in json.loads((made["plain"] / SHARD / "zarr.json").read_text())["attributes"]
    assert not any(c.startswith("checksum_final") for c in plain.index.column_names)
    assert set(plain.read(0)) == {"input_ids", "loss_mask", "hidden", "topk_ids", "topk_logprobs"}
    for name in ("input_ids", "loss_mask", "hidden", "topk_ids", "topk_logprobs"):  # the same batches: same bytes
        a, b = made["plain"] / SHARD / name, made["bf16"] / SHARD / name
        files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
        assert files and files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
        assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files), name


def test_fp8_final_hidden_within_the_quantisation_error(made):
    s, ref = open_store(made["fp8"]), open_store(made["bf16"])
    assert s.hidden_dtype == "fp8" and verify_store(made["fp8"]).ok
    assert (made["fp8"] / SHARD / "final_hidden_scale").is_dir()
    for sid in s.sample_ids():
        got, want = s.read(sid)["final_hidden"].float(), ref.read(sid)["final_hidden"].float()
        # e4m3 keeps 3 mantissa bits: relative error <= 1/16 per value, plus the per-token scale's step
        amax = want.abs().amax(-1, keepdim=True)
        assert ((got - want).abs() <= want.abs() / 16 + amax / 448 * 2 + 2e-2 * amax).all()


def test_bytes_per_token_of_final_hidden(made):
    """2*H bytes per token in bf16, H e4m3 bytes + one float32 scale in fp8: uncompressed as `hidden` is (the
    scale is blosc-zstd, as `hidden_scale` is, so at most 4 bytes)."""
    H = open_store(made["bf16"]).hidden_size
    for name, per_token in (("bf16", 2 * H), ("fp8", H + 4)):
        s = open_store(made[name])
        arrays = [made[name] / SHARD / a for a in ("final_hidden", "final_hidden_scale")]
        size = sum(p.stat().st_size for a in arrays if a.is_dir() for p in a.rglob("c/**/*") if p.is_file())
        # objects hold whole inner chunks (16 tokens here) plus the sharding codec's index
        assert (per_token - 4 * (name == "fp8")) * s.num_tokens <= size
        assert size <= per_token * (s.num_tokens + 16) + 64 * (s.num_tokens // 16 + 2)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_verify_and_read_catch_a_changed_final_hidden_byte(made, tmp_path):
    store = _copy(made["bf16"], tmp_path / "store")
    obj = store / SHARD / "final_hidden" / "c" / "0" / "0"  # uncompressed: a flipped byte still decodes
    b = bytearray(obj.read_bytes())
    b[5] ^= 0xFF
    obj.write_bytes(bytes(b))
    s = open_store(store)
    sid = int(s.index.filter(pc.equal(s.index["offset"], 0))["sample_id"][0].as_py())  # plan order, not id order
    with pytest.raises(DamagedSampleError) as e:
        s.read(sid)
    assert e.value.field == "final_hidden" and f"sample {sid} in {SHARD}" in str(e.value)
    s.read(sid, fields=["input_ids", "hidden", "topk_ids"])  # the other arrays are intact
    assert verify_store(store).problems == [f"{SHARD} sample {sid}: final_hidden checksum mismatch (stored bytes changed)"]


def test_verify_catches_a_missing_final_hidden_object(made, tmp_path):
    store = _copy(made["fp8"], tmp_path / "store")
    (store / SHARD / "final_hidden_scale" / "c" / "0" / "0").unlink()  # reads back as zeros
    problems = verify_store(store).problems
    assert problems and all("final_hidden_scale checksum mismatch" in p for p in problems)
    res = CliRunner().invoke(main, ["verify", str(store)])
    assert res.exit_code != 0 and "final_hidden_scale" in res.output and "Traceback" not in res.output


def test_a_store_without_it_is_refused_for_dspark(made):
    s = open_store(made["plain"])
    with pytest.raises(StoreError) as e:
        require_final_hidden(s.manifest, s.path)
    msg = str(e.value)
    assert f"the store {s.path} has no final hidden states; DSpark needs them" in msg
    assert "recapture with `dflash precompute --final-hidden`" in msg and "\n" not in msg
    with pytest.raises(StoreError, match="has no final hidden states"):
        s.read(0, fields=["input_ids", "final_hidden"])
    require_final_hidden(open_store(made["bf16"]).manifest, made["bf16"])  # has them: no error


def _append(made, out: Path, data: Path, *flags) -> object:
    args = ["precompute", "--target", made["target"], "--data", data, "--out", out, "--gpus", "cpu", "--append",
            "--max-length", "256", "--topk", "4", "--target-layers", "1,2", "--commit-every-tokens", "200",
            "--store-chunk-tokens", "16", *flags]
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def more(made):
    return make_conversations_jsonl(made["dir"] / "more.jsonl", 12, seed=9)


@pytest.mark.slow
def test_append_keeps_final_hidden_in_every_part(made, more, tmp_path):
    store = _copy(made["bf16"], tmp_path / "store")
    res = _append(made, store, more, "--final-hidden", "--shards", "2")
    assert res.exit_code == 0, res.output
    s = open_store(store, require_complete=True)
    assert part_path(store, 1).exists() and len(s.shards) == 3 and verify_store(store).ok
    for i in range(3):
        assert (store / f"shard-{i:05d}" / "final_hidden").is_dir()
    fresh = build_store(tmp_path / "fresh", made["target"], more, final_hidden=True, **OPTS)
    f = open_store(fresh)
    by_ids = {tuple(f.read(x)["input_ids"].tolist()): f.read(x)["final_hidden"] for x in f.sample_ids()}
    new = [x for x in s.sample_ids() if x >= 8]
    assert new
    for sid in new:  # the new part's samples hold what a store of only them holds
        r = s.read(sid)
        want = by_ids[tuple(r["input_ids"].tolist())]
        assert r["final_hidden"].shape == want.shape
        assert (r["final_hidden"] == want).float().mean() > 0.99


@pytest.mark.parametrize("src, flags, store_has, run_has", [
    ("bf16", (), True, False),
    ("plain", ("--final-hidden",), False, True),
])
def test_an_append_with_another_final_hidden_is_refused(made, more, src, flags, store_has, run_has):
    res = _append(made, made[src], more, *flags)
    assert res.exit_code != 0 and "Traceback" not in res.output
    said = res.output.replace("\n", " ")
    assert f"final_hidden (--final-hidden): store has {store_has}, this run has {run_has}" in said, res.output
    assert not part_path(made[src], 1).exists()
