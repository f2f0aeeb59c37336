"""The mask token of a target whose tokenizer fills its embedding table (SmolLM2: 49152 ids, no mask token):
an added special token the chat template and the store never use, named in the start-up line and the run's
config; the next one when the store holds it; a clear refusal when none is left."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dflash.errors import ConfigError
from dflash.store import open_store
from dflash.train.preflight import resolve_mask_token
from helpers import build_store, make_conversations
from processes import invoke

ROOT = Path(__file__).resolve().parents[2]
SMOL_TOKENIZER = ROOT / "tests" / "assets" / "smollm2-tokenizer"
MARKERS = ["<repo_name>", "<reponame>", "<file_sep>", "<filename>", "<gh_stars>", "<issue_start>", "<issue_comment>",
           "<issue_closed>", "<jupyter_start>", "<jupyter_text>", "<jupyter_code>", "<jupyter_output>",
           "<jupyter_script>", "<empty_output>"]  # ids 3..16, in id order


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """A tiny random Llama with SmolLM2's real tokenizer and vocabulary, and a store of 6 conversations."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("smol")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    target = d / "target"
    LlamaForCausalLM(cfg).save_pretrained(target)
    for f in SMOL_TOKENIZER.iterdir():
        if f.name != "README.md":
            shutil.copy(f, target / f.name)
    store = _store(d / "store", target, make_conversations(6))
    return target, store


def _store(out, target, rows):
    data = Path(out).with_suffix(".jsonl")
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return build_store(out, target, data, target_layers=[0], topk=2, max_length=128, writer="thread")


def test_train_picks_an_unused_code_marker_and_says_so(smol, tmp_path):
    target, store = smol
    run = tmp_path / "run"
    rc, out, err = invoke(["--store", store, "--target", target, "--out", run, "--gpus", "cpu:1", "--steps", "1",
                           "--block-size", "4", "--num-layers", "1", "--compile", "off", "--num-workers", "1",
                           "--save-every", "0"], command="train", cwd=tmp_path)
    assert rc == 0, err[-3000:]
    line = "mask token 3 (added special token unused by the chat template '<repo_name>', absent from the store)"
    assert line in out + err
    rec = json.loads((run / "config.json").read_text())
    assert rec["mask_token"]["id"] == 3 and "'<repo_name>'" in rec["mask_token"]["source"]
    assert rec["drafter"]["dflash_config"]["mask_token_id"] == 3


def test_a_store_holding_the_marker_moves_to_the_next_and_none_left_is_refused(smol, tmp_path):
    target, store = smol
    assert resolve_mask_token(None, str(target), 49152, open_store(store))[0] == 3
    rows = make_conversations(4, seed=1)
    rows[2]["messages"][0]["content"] = "see <repo_name> here"  # the tokenizer reads it as id 3
    got = resolve_mask_token(None, str(target), 49152, open_store(_store(tmp_path / "s1", target, rows)))
    assert got == (4, "added special token unused by the chat template '<reponame>', absent from the store")
    rows[3]["messages"][0]["content"] = " ".join(MARKERS)  # first: --max-length cuts the end of a long row
    with pytest.raises(ConfigError, match="no spare token for the drafter's mask"):
        resolve_mask_token(None, str(target), 49152, open_store(_store(tmp_path / "s2", target, rows)))
    # a growing store cannot prove a token absent: refused, naming a candidate
    with pytest.raises(ConfigError, match=r"--mask-token-id, e.g. 3 \('<repo_name>'"):
        resolve_mask_token(None, str(target), 49152, open_store(store), growing=True)
