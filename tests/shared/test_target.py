"""Target loading and capture: hooks give exactly `output_hidden_states`, chunked top-k equals full top-k."""

from __future__ import annotations

import pytest
import torch

from dflash.errors import TargetError
from dflash.target_model.capture import (
    Capture,
    check_layers,
    load_target,
    load_tokenizer,
    real_positions,
    topk_logprobs,
)
from helpers import make_tiny_target

CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def target(request, tmp_path_factory):
    d = make_tiny_target(tmp_path_factory.mktemp(request.param), arch=request.param, num_layers=4)
    return d, load_target(d, torch.float32, CPU)


@pytest.mark.parametrize("topk,compile", [(0, "off"), (5, "off"), (5, "on")])
def test_capture_equals_output_hidden_states(target, topk, compile):
    _, model = target
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (3, 19))
    lengths = torch.tensor([19, 11, 4])
    layers = [2, 0, 3]  # order is kept; the last layer gets the final norm like hidden_states[-1]
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True, use_cache=False)
    got = Capture(model, layers, topk=topk, lm_head_chunk=7, compile=compile)(ids, lengths)
    want = torch.cat([ref.hidden_states[i + 1] for i in layers], dim=-1)
    assert got["hidden"].shape == (3, 19, len(layers) * model.config.hidden_size)
    assert torch.equal(got["hidden"], want)  # fp32: the hooks see the very tensors transformers returns
    if topk == 0:
        assert "topk_ids" not in got
        return
    lp, ix = torch.log_softmax(ref.logits.float(), dim=-1).topk(topk, dim=-1)
    for b, n in enumerate(lengths.tolist()):
        assert torch.equal(got["topk_ids"][b, :n], ix[b, :n])
        torch.testing.assert_close(got["topk_logprobs"][b, :n], lp[b, :n], rtol=0, atol=1e-5)
        assert got["topk_ids"][b, n:].eq(0).all() and got["topk_logprobs"][b, n:].eq(0).all()


def test_right_padding_does_not_change_real_positions(target):
    _, model = target
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, 9))
    padded = torch.cat([ids, torch.zeros(1, 6, dtype=torch.long)], dim=1)
    cap = Capture(model, [1, 2], topk=3)
    a, b = cap(ids), cap(padded, torch.tensor([9]))
    torch.testing.assert_close(a["hidden"], b["hidden"][:, :9], rtol=1e-5, atol=1e-5)
    assert torch.equal(a["topk_ids"], b["topk_ids"][:, :9])


def test_early_stop_skips_later_layers(target):
    _, model = target
    seen = []
    handle = model.model.layers[3].register_forward_hook(lambda *a: seen.append(3))
    try:
        Capture(model, [0, 1], topk=0)(torch.zeros(1, 4, dtype=torch.long))
        assert seen == []  # the forward stopped after layer 1
        Capture(model, [0, 1], topk=2)(torch.zeros(1, 4, dtype=torch.long))
        assert seen == [3]  # top-k needs the whole model
    finally:
        handle.remove()


def test_layer_ids_checked():
    with pytest.raises(TargetError, match=r"out of range.*4 layers"):
        check_layers([1, 4], 4, "t")
    with pytest.raises(TargetError, match="repeats"):
        check_layers([1, 1], 4, "t")


def test_load_errors_name_the_path(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(TargetError, match=str(missing)):
        load_target(missing, torch.float32, CPU)
    with pytest.raises(TargetError, match=str(missing)):
        load_tokenizer(missing)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "qwen3"}')
    with pytest.raises(TargetError, match=str(broken)):
        load_target(broken, torch.float32, CPU)


def test_tokenizer_without_chat_template(tmp_path):
    d = make_tiny_target(tmp_path, arch="llama", chat_template=False, hidden_size=32, num_layers=2)
    with pytest.raises(TargetError, match="no chat template"):
        load_tokenizer(d)


def _reference_topk(logits, k, scaling=None, softcap=None):
    x = logits.float()
    if scaling:
        x = x / scaling
    if softcap:
        x = torch.tanh(x / softcap) * softcap
    return torch.log_softmax(x, dim=-1).topk(k, dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling,softcap", [(None, None), (4.0, None), (None, 30.0), (0.5, 10.0)])
@pytest.mark.parametrize("compiled", [False, True])
def test_topk_logprobs_matches_fp32_log_softmax(dtype, scaling, softcap, compiled):
    """Top-k on the raw logits + fused fp32 log-normaliser == fp32 log_softmax then top-k.  bf16 logits
    have ties, so ids are checked through the reference log-prob of each returned id."""
    torch.manual_seed(0)
    fn = torch.compile(topk_logprobs, dynamic=True) if compiled else topk_logprobs
    for n in (13, 5):  # a second, shorter chunk must not recompile into a wrong shape
        logits = (torch.randn(n, 3001) * 6).to(dtype)
        ids, lp = fn(logits, 8, scaling, softcap)
        ref_lp, _ = _reference_topk(logits, 8, scaling, softcap)
        full = _reference_topk(logits, logits.shape[-1], scaling, softcap)
        full_lp = torch.empty(n, logits.shape[-1]).scatter_(1, full[1], full[0])
        assert ids.dtype == torch.int64 and lp.dtype == torch.float32 and ids.shape == (n, 8)
        torch.testing.assert_close(lp, ref_lp, rtol=0, atol=2e-5)
        torch.testing.assert_close(full_lp.gather(1, ids), lp, rtol=0, atol=2e-5)
        assert (lp[:, :-1] >= lp[:, 1:]).all()  # sorted, largest first


def test_real_positions_are_found_on_the_host():
    rows = real_positions(3, 5, torch.tensor([5, 2, 0]))
    assert rows.device.type == "cpu" and rows.tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert real_positions(2, 4, [4, 4]) is None and real_positions(2, 4, None) is None
