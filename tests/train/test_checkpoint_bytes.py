"""A checkpoint file is a function of its tensors and metadata: safetensors writes the metadata in hash-map
order, which changes from call to call, and save_safetensors puts it in sorted order."""

from __future__ import annotations

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dflash.train.checkpoint import check_safetensors, save_safetensors


def test_the_same_tensors_and_metadata_give_the_same_bytes(tmp_path):
    tensors = {"layers.0.mlp.up_proj.weight": torch.arange(12.0).reshape(3, 4),
               "norm.weight": torch.ones(4, dtype=torch.bfloat16)}
    meta = {f"key{i}": f"value {i}, é" for i in range(8)}
    files = []
    for i in range(6):
        path = tmp_path / f"{i}.safetensors"
        save_safetensors(tensors, path, dict(reversed(meta.items())) if i % 2 else meta)
        files.append(path.read_bytes())
    assert len(set(files)) == 1
    path = tmp_path / "0.safetensors"
    check_safetensors(path)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == meta
    loaded = load_file(str(path))
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
