"""Rows in stored form, for the shard writer and the write pipeline: encoding hidden states (bf16 bits, or
e4m3 bits + a per-token-per-layer scale), numpy conversion, the writer's reusable token buffers, fsync."""

from __future__ import annotations

import os

import numpy as np
import torch

from dflash.durable import fsync_dir

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def pow2_floor(x: float) -> int:
    return 1 << max(0, int(np.floor(np.log2(max(1.0, x)))))


def encode_hidden_tensors(h: torch.Tensor, hidden_dtype: str, num_layers: int) -> dict[str, torch.Tensor]:
    """[..., L*H] float tensor -> the stored form on its own device: `hidden` as int16 (bf16 bits) or uint8
    (e4m3 bits) [..., L*H], plus `hidden_scale` [..., L] float32 for fp8.  Every token is encoded on its
    own, so a batch encodes to exactly the bits of its samples encoded one by one."""
    lead = h.shape[:-1]
    if hidden_dtype == "bf16":
        return {"hidden": h.to(torch.bfloat16).contiguous().view(torch.int16)}
    x = h.float().reshape(*lead, num_layers, -1)  # quantise on the tensor's device (GPU in precompute)
    amax = x.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"hidden": q.reshape(*lead, -1).view(torch.uint8), "hidden_scale": scale}


def dequantise_fp8(bits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The inverse of the fp8 encoding, on the tensors' device: e4m3 bits (uint8) [..., L*H] and the scale
    [..., L] -> bf16 [..., L*H].  Computed in fp32 then rounded once, so the same bits give the same bf16
    values on the CPU (a worker) and on a GPU (the training step)."""
    lead, num_layers = bits.shape[:-1], scale.shape[-1]
    x = bits.view(torch.float8_e4m3fn).float().reshape(*lead, num_layers, -1)
    return (x * scale.float()[..., None]).reshape(*lead, -1).to(torch.bfloat16)


def encode_hidden(hidden, hidden_dtype: str, num_layers: int) -> dict[str, np.ndarray]:
    """[T, L*H] float tensor -> stored arrays: bf16 bits, or e4m3 bits + per-token-per-layer scale."""
    h = hidden if isinstance(hidden, torch.Tensor) else torch.as_tensor(np.asarray(hidden))
    h = h.detach()
    h = h.reshape(h.shape[0], -1)  # [T, L, H] is accepted too
    enc = encode_hidden_tensors(h, hidden_dtype, num_layers)
    out = {k: v.cpu().numpy() for k, v in enc.items()}
    if hidden_dtype == "bf16":
        out["hidden"] = out["hidden"].view(np.uint16)
    return out


def final_named(encoded: dict) -> dict:
    """The stored form of the target's last hidden state [..., H], encoded by `encode_hidden(_tensors)` as
    one layer (the scale scheme of `hidden`), under its own array names: final_hidden[, final_hidden_scale]."""
    return {f"final_{k}": v for k, v in encoded.items()}


def as_stored(x, dtype: np.dtype) -> np.ndarray:
    """numpy rows in the stored dtype: an integer array of the same width is reinterpreted (int16 bf16
    bits as uint16), anything else converted."""
    if isinstance(x, torch.Tensor):
        x = x.detach()
        x = (x.view(torch.int16) if x.dtype == torch.bfloat16 else x).cpu().numpy()
    x = np.asarray(x)
    if x.dtype != dtype and x.dtype.itemsize == dtype.itemsize and x.dtype.kind in "iu" and dtype.kind in "iu":
        x = x.view(dtype)
    return np.ascontiguousarray(x, dtype=dtype)


def fsync_files(paths) -> None:
    """fsync files (missing ones skipped) and the directories holding them, including a new object's
    own directory entry (`hidden/c/<k>` of `hidden/c/<k>/0`)."""
    dirs = set()
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        dirs.add(p.parent)
        if p.parent.name.isdigit():
            dirs.add(p.parent.parent)
    for d in dirs:
        fsync_dir(d)


class TokenBuffer:
    """A token-major buffer for one array.  append() copies (callers may reuse their tensors); take(k)
    lends the first k rows out (to an I/O thread) and moves the rest to a spare buffer; give_back()
    returns the lent buffer once its write is done.  Reusing buffers matters: a fresh 256 MB numpy
    buffer page-faults on first touch and fills far slower than a reused one."""

    def __init__(self, dtype: np.dtype, row: tuple, capacity: int):
        self.a, self.n = np.empty((capacity, *row), dtype), 0
        self._spare: list[np.ndarray] = []

    def append(self, x: np.ndarray) -> None:
        if self.n + len(x) > len(self.a):
            grown = np.empty((max(2 * len(self.a), self.n + len(x)), *self.a.shape[1:]), self.a.dtype)
            grown[: self.n] = self.a[: self.n]
            self.a = grown
        self.a[self.n : self.n + len(x)] = x
        self.n += len(x)

    def view(self) -> np.ndarray:
        return self.a[: self.n]

    def take(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(the first k rows, the buffer they live in: hand it to give_back() when done with them)."""
        lent, rest = self.a, self.a[k : self.n]
        nxt = self._spare.pop() if self._spare else None
        if nxt is None or len(nxt) < len(lent):
            nxt = np.empty_like(lent)
        nxt[: len(rest)] = rest
        self.a, self.n = nxt, len(rest)
        return lent[:k], lent

    def give_back(self, buf: np.ndarray) -> None:
        if len(self._spare) < 2 and len(buf) >= len(self.a):  # one that grew makes smaller ones useless
            self._spare.append(buf)
