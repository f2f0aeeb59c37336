"""MicroBatch: one packed training micro-batch, and the Packer that builds it one sample at a time.

A micro-batch is R packed rows.  Each row holds a few samples back to back: their context features
(S positions) and their block streams (Q positions, `num_anchors` blocks of `block_size` per sample),
with the closed-form mask metadata of `dflash.drafter.masks` that keeps the samples apart.  It is built
in a DataLoader worker (dflash.train.loader) and pickled to the training process; its tensors travel in
shared memory, as the DataLoader sends any tensor.  Its small tensors (all but the context features) are
views of one buffer, the batch's `arena`: one shared-memory handle crosses the process boundary, and one
page-locking and one copy take them to the device, where each of ~20 tensors took its own (a handle
costs the receiving process a socket round trip).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from dflash.drafter import masks
from dflash.store.rows import dequantise_fp8
from dflash.train.loss import IGNORE


@dataclass
class MicroBatch:
    """One micro-batch of R rows, S context positions and Q block positions per row."""

    ctx_positions: torch.Tensor
    """[R, S] int64: each context token's position inside its own sample (0 at the sample's start; 0 on padding)."""
    block_input_ids: torch.Tensor
    """[R, Q] int64: the drafter's block inputs: the anchor token, then the mask token (also on padding)."""
    block_positions: torch.Tensor
    """[R, Q] int64: each block token's position in its sample's coordinates (anchor + k; 0 on padding)."""
    labels: torch.Tensor
    """[R, Q] int64: the token each block position predicts, IGNORE where unsupervised or padding."""
    loss_weight: torch.Tensor
    """[R, Q] float32: the loss weight of each label (the position decay), 0 where the label is IGNORE."""
    block_pos_in_block: torch.Tensor
    """[R, Q] int64: k, the offset of each block token from its block's anchor (0 on padding)."""
    mask: dict[str, torch.Tensor]
    """The rows' attention-mask metadata (masks.mask_metadata, stacked: each tensor [R, ...]), int32."""
    label_index: torch.Tensor
    """[L] int64: flat indices into labels.reshape(-1) of the labels that are not IGNORE, made on the host
    so that the loss needs no nonzero() (a device-to-host sync)."""
    loss_weight_sum: float
    """loss_weight summed (in float64): the step's loss denominator, known without a sync."""
    sample_ids: torch.Tensor
    """[N] int64: the store ids of the samples packed, row by row."""
    num_samples: int
    """N, the samples packed (damaged ones skipped are not counted)."""
    num_damaged: int
    """Samples of this micro-batch skipped as damaged (--skip-damaged)."""
    num_ctx_tokens: int
    """Context tokens of the packed samples (padding not counted)."""
    num_block_tokens: int
    """Block tokens of the packed samples (padding not counted)."""
    epoch: int
    """The epoch whose plan this micro-batch is from."""
    index: int
    """Its position in that epoch's plan (-1 when built outside a plan)."""
    ctx_hidden: torch.Tensor | None = None
    """[R, S, L*H] bf16: the target's context features, zero on padding; from an fp8 store, their e4m3 bits
    (uint8) until `dequantised()`; None while they wait in batch slot `slot` (dflash.train.batch_slots),
    which the DeviceFeeder views."""
    ctx_scale: torch.Tensor | None = None
    """[R, S, L] float32: the per-token, per-layer scales of fp8 context features (zero on padding), or None
    when ctx_hidden is bf16.  The bits travel to the device at half the bytes of bf16 and are dequantised
    there, not in the worker, where dequantising would cost more than reading the store."""
    topk_ids: torch.Tensor | None = None
    """[R, Q, K] int64: the target's top-K token ids at each label's source position (--kd), else None."""
    topk_logprobs: torch.Tensor | None = None
    """[R, Q, K] float32: their log-probabilities (--kd), else None."""
    final_hidden: torch.Tensor | None = None
    """[R, Q, H] bf16: the target's pre-norm last hidden state at each label's source position, when the
    drafter family needs it (StoreNeeds.final_hidden), else None."""
    seq: int | None = None
    """Its position in the loader's order when the loader numbers batches (batch slots), else None."""
    slot: int | None = None
    """The batch slot that holds ctx_hidden, or None when ctx_hidden is a tensor of its own."""
    ctx_shape: tuple[int, ...] | None = None
    """ctx_hidden's shape (R, S, L*H) while it is in a slot, else None."""
    arena: torch.Tensor | None = None
    """uint8: the buffer whose views the small tensors are (`Packer.finish`), or None when each tensor
    has its own storage."""

    def _in_arena(self, t: torch.Tensor) -> bool:
        return self.arena is not None and t.untyped_storage().data_ptr() == self.arena.untyped_storage().data_ptr()

    def _fields(self) -> Iterator[tuple[str, object]]:
        for f in dataclasses.fields(self):
            if f.name != "arena":
                yield f.name, getattr(self, f.name)

    def _rebased(self, arena: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> MicroBatch:
        """A copy over `arena` (this batch's, moved): each view of the old arena becomes the same view of
        the new one, each other tensor gets fn."""
        return dataclasses.replace(self, arena=arena,
                                   **self._mapped(lambda t: _view(arena, t) if self._in_arena(t) else fn(t)))

    def _mapped(self, fn) -> dict:
        """{field: fn(tensor)} over the tensor fields but the arena, the mask's dict mapped inside."""
        out = {}
        for name, v in self._fields():
            if isinstance(v, torch.Tensor):
                out[name] = fn(v)
            elif isinstance(v, dict):
                out[name] = {k: fn(t) for k, t in v.items()}
        return out

    def __getstate__(self) -> dict:
        # Views of the arena cross as (dtype, offset, shape, stride): pickling each view would send the
        # arena's storage again, a shared-memory handle each.
        state = dict(self.__dict__)
        if self.arena is not None:
            state.update(self._mapped(lambda t: ("view", t.dtype, t.storage_offset(), tuple(t.shape), t.stride())
                                      if self._in_arena(t) else t))
        return state

    def __setstate__(self, state: dict) -> None:
        arena = state.get("arena")

        def back(v):
            if isinstance(v, tuple) and v and v[0] == "view":
                _, dtype, offset, shape, stride = v
                return torch.empty(0, dtype=dtype, device=arena.device).set_(arena.untyped_storage(), offset, shape, stride)
            return v

        self.__dict__.update({k: ({kk: back(t) for kk, t in v.items()} if isinstance(v, dict) else back(v))
                              for k, v in state.items()})

    @property
    def shape(self) -> tuple[int, int, int]:
        """(R, Q, S): what the compiled step specialises on."""
        R, Q = self.labels.shape
        return R, Q, self.ctx_positions.shape[1]

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> MicroBatch:
        """A copy with fn applied to every tensor, the mask's included, each then its own (no arena); the
        other fields shared."""
        return dataclasses.replace(self, arena=None, **self._mapped(fn))

    def _moved(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> MicroBatch:
        """map_tensors for a fn that keeps every byte (a copy elsewhere): the arena moves once."""
        return self.map_tensors(fn) if self.arena is None else self._rebased(fn(self.arena), fn)

    def dequantised(self) -> MicroBatch:
        """This batch with bf16 context features, dequantised on the batch's device (a copy when they are
        fp8 bits; the batch itself when they are bf16 already)."""
        if self.ctx_scale is None:
            return self
        return dataclasses.replace(self, ctx_hidden=dequantise_fp8(self.ctx_hidden, self.ctx_scale), ctx_scale=None)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> MicroBatch:
        return self._moved(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> MicroBatch:
        """Page-locked copies of the tensors: what DataLoader(pin_memory=True) calls on a batch of this type."""
        return self._moved(lambda t: t.pin_memory())

    def tensors(self) -> Iterator[torch.Tensor]:
        """The batch's buffers: the arena, if any, then every tensor outside it."""
        if self.arena is not None:
            yield self.arena
        for _, v in self._fields():
            for t in (v.values() if isinstance(v, dict) else [v] if isinstance(v, torch.Tensor) else []):
                if not self._in_arena(t):
                    yield t

    def consolidated(self) -> MicroBatch:
        """This batch with its small tensors (all but the context and final hidden states) copied into one
        arena, in shared memory inside a DataLoader worker (as loader._batch_tensor allocates)."""
        # Sized by the batch's shape first, so those views keep their offsets from batch to batch of a shape
        # (what a compiled step sees); the ones sized by its samples and labels last.
        names = [n for n, _ in self._fields() if n not in ("ctx_hidden", "final_hidden", "label_index", "sample_ids")]
        small = [t for name in names + ["label_index", "sample_ids"] for v in [getattr(self, name)]
                 for t in (v.values() if isinstance(v, dict) else [v] if isinstance(v, torch.Tensor) else [])]
        offsets, n = [], 0
        for t in small:
            offsets.append(n)
            n += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        arena = torch.zeros(n, dtype=torch.uint8)  # the gaps between views too: the same batch, the same bytes
        if torch.utils.data.get_worker_info() is not None:
            arena.share_memory_()
        views = {}
        for t, o in zip(small, offsets):
            v = arena[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            v.copy_(t)
            views[id(t)] = v
        return dataclasses.replace(self, arena=arena, **self._mapped(lambda t: views.get(id(t), t)))


_ALIGN = 64  # bytes: every view of an arena starts aligned for any dtype (and for vectorised kernels)


def _view(arena: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The view of `arena` that `like` is of its own arena (the same dtype, offset, shape and strides)."""
    return torch.empty(0, dtype=like.dtype, device=arena.device).set_(arena.untyped_storage(), like.storage_offset(),
                                                                        like.shape, like.stride())


class Packer:
    """Builds one MicroBatch: `add` puts a sample at the end of the current row, `end_row` closes that
    row (its padding and mask metadata), `finish` closes the rest and returns the batch.

    A sample is the loader's per-sample dict (loader.PackedDataset._sample): sid, T, hidden (or None),
    anchors and its block stream (input_ids, positions, labels, weights, pos_in_block; topk_* under kd).
    `ctx_hidden` [R, S, L*H] is written in place (it may be a batch slot); with `ctx_scale` [R, S, L] it holds
    fp8 bits and their scales (MicroBatch.ctx_scale)."""

    def __init__(self, ctx_hidden: torch.Tensor, Q: int, block_size: int, mask_token_id: int,
                 sliding_window: int | None = None, topk: int | None = None, final_hidden: int | None = None,
                 ctx_scale: torch.Tensor | None = None):
        R, S = ctx_hidden.shape[:2]
        self.R, self.S, self.Q, self.block_size, self.sliding_window = R, S, Q, block_size, sliding_window
        self.ctx_hidden, self.ctx_scale = ctx_hidden, ctx_scale
        self.ctx_positions = torch.zeros(R, S, dtype=torch.long)
        self.block_input_ids = torch.full((R, Q), mask_token_id, dtype=torch.long)
        self.block_positions = torch.zeros(R, Q, dtype=torch.long)
        self.labels = torch.full((R, Q), IGNORE, dtype=torch.long)
        self.loss_weight = torch.zeros(R, Q, dtype=torch.float32)
        self.block_pos_in_block = torch.zeros(R, Q, dtype=torch.long)
        kd = topk is not None
        self.topk_ids = torch.zeros(R, Q, topk, dtype=torch.long) if kd else None
        self.topk_logprobs = torch.zeros(R, Q, topk, dtype=torch.float32) if kd else None
        self.final_hidden = torch.zeros(R, Q, final_hidden, dtype=torch.bfloat16) if final_hidden else None
        self.metas: list[dict[str, torch.Tensor]] = []
        self.packed: list[dict] = []
        self._open_row()

    def _open_row(self) -> None:
        self.c0 = self.q0 = 0
        self.starts, self.lens, self.block_sample, self.block_anchor = [], [], [], []

    def add(self, s: dict, read_hidden: Callable[[torch.Tensor], None] | None = None) -> None:
        """Append sample `s` to the current row.  Without s["hidden"], `read_hidden(dest, scale_dest)` writes
        its features (and, for fp8 bits, their scales; else scale_dest is None) into the row; if that raises,
        the sample is not added (the next one takes its place)."""
        r, c0, q0 = len(self.metas), self.c0, self.q0
        T, n = s["T"], len(s["labels"])
        if s["hidden"] is None:
            read_hidden(self.ctx_hidden[r, c0 : c0 + T], None if self.ctx_scale is None else self.ctx_scale[r, c0 : c0 + T])
        else:
            self.ctx_hidden[r, c0 : c0 + T] = s["hidden"]
        self.ctx_positions[r, c0 : c0 + T] = torch.arange(T)
        self.block_input_ids[r, q0 : q0 + n] = torch.from_numpy(s["input_ids"])
        self.block_positions[r, q0 : q0 + n] = torch.from_numpy(s["positions"])
        self.labels[r, q0 : q0 + n] = torch.from_numpy(s["labels"])
        self.loss_weight[r, q0 : q0 + n] = torch.from_numpy(s["weights"].astype(np.float32))
        self.block_pos_in_block[r, q0 : q0 + n] = torch.from_numpy(s["pos_in_block"])
        if self.topk_ids is not None:
            self.topk_ids[r, q0 : q0 + n] = s["topk_ids"].long()
            self.topk_logprobs[r, q0 : q0 + n] = s["topk_logprobs"].float()
        if self.final_hidden is not None:
            self.final_hidden[r, q0 : q0 + n] = s["final_hidden"].to(torch.bfloat16)
        self.block_sample += [len(self.starts)] * len(s["anchors"])
        self.starts.append(c0)
        self.lens.append(T)
        self.block_anchor += s["anchors"].tolist()
        self.c0, self.q0 = c0 + T, q0 + n
        self.packed.append(s)

    def end_row(self) -> None:
        r = len(self.metas)
        self.ctx_hidden[r, self.c0 :] = 0  # padding: masked out, but a NaN bit pattern would leak through P @ V
        if self.ctx_scale is not None:  # (and 0 bits x a damaged sample's inf scale would be NaN)
            self.ctx_scale[r, self.c0 :] = 0
        self.metas.append(masks.mask_metadata(self.starts, self.lens, self.block_sample, self.block_anchor,
                                              self.block_size, self.S, self.Q, sliding_window=self.sliding_window))
        self._open_row()

    def finish(self, epoch: int, index: int, num_damaged: int) -> MicroBatch:
        while len(self.metas) < self.R:  # the last micro-batch of a plan may have fewer rows
            self.end_row()
        return MicroBatch(
            ctx_hidden=self.ctx_hidden,
            ctx_scale=self.ctx_scale,
            ctx_positions=self.ctx_positions,
            block_input_ids=self.block_input_ids,
            block_positions=self.block_positions,
            labels=self.labels,
            loss_weight=self.loss_weight,
            block_pos_in_block=self.block_pos_in_block,
            topk_ids=self.topk_ids,
            topk_logprobs=self.topk_logprobs,
            final_hidden=self.final_hidden,
            mask=masks.stack_metadata(self.metas),
            label_index=(self.labels.reshape(-1) != IGNORE).nonzero().squeeze(1),
            loss_weight_sum=float(self.loss_weight.double().sum()),
            sample_ids=torch.tensor([s["sid"] for s in self.packed], dtype=torch.long),
            num_samples=len(self.packed),
            num_damaged=num_damaged,
            num_ctx_tokens=sum(s["T"] for s in self.packed),
            num_block_tokens=sum(len(s["labels"]) for s in self.packed),
            epoch=epoch,
            index=index,
        ).consolidated()


__all__ = ["MicroBatch", "Packer"]
