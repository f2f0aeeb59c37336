"""WritePipeline: a ShardWriter on a background thread, fed from the GPU through reusable host buffers.

Precompute's main thread runs the target on batch i+1 while this pipeline's writer thread appends and
commits batch i, so the GPU never waits for the store (only when every host buffer is still in use,
which bounds host memory):

    main thread (GPU)                                   writer thread ("dflash-store-writer")
    capture(batch) -> submit():                         take the next item (FIFO: plan order kept)
      fp8: quantise on the device (bf16: cast)            wait for its copy event
      take a free slot (blocks while all are in use)      ShardWriter.append_encoded() per sample
      copy each sample's real rows into the slot's        (copies into the writer's buffer; commits,
      pinned buffers, packed, non_blocking, on a side     flushes and fsyncs happen here)
      stream; record an event; queue the item             give the slot back to the pool

Why the thread is safe: it touches only numpy, zarr, pyarrow, xxhash, os and the host (pinned) tensors
of its slots through numpy views, plus `torch.cuda.set_device` and `Event.synchronize()` on an event the
main thread recorded.  It never runs a model, compiled code, or builds flex-attention masks (the
project keeps all of those on the main thread; one process per GPU).  The ShardWriter is
used by one thread at a time: the caller makes it and reads its committed state (resume) before the
pipeline starts; from then on only the writer thread calls it, until finalize()/close() have joined the
thread.

Host memory: `slots` buffers of `capacity_tokens` x bytes/token each (pinned on CUDA; torch's pinned
allocator rounds each up to a power of two), allocated on first use and reused, plus the writer's own
buffers (~3 x 256 MB of hidden states).

Errors: an exception in the writer thread stops all further appends (later batches are dropped, so the
store keeps a prefix of the batch plan) and is re-raised, the same exception object, in the main thread
at the next submit(), or at finalize()/close().  The ShardWriter's commit protocol guarantees that
nothing half-written is ever committed; a failed object write poisons the writer (see writer.py).
"""

from __future__ import annotations

import math
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from dflash.store.rows import encode_hidden_tensors, final_named
from dflash.store.writer import ShardWriter


class _Slot:
    """One reusable set of host buffers (pinned when the device is CUDA), one flat byte buffer per array."""

    def __init__(self, pin: bool, device: torch.device):
        self.pin = pin
        self.bufs: dict[str, torch.Tensor] = {}
        self.event = torch.cuda.Event() if device.type == "cuda" else None

    def view(self, name: str, dtype: torch.dtype, shape: tuple, capacity_rows: int) -> torch.Tensor:
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        need = shape[0] * row_bytes
        buf = self.bufs.get(name)
        if buf is None or buf.numel() < need:
            size = max(need, capacity_rows * row_bytes)
            buf = self.bufs[name] = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        return buf[:need].view(dtype).view(shape)


@dataclass
class _Item:
    slot: _Slot
    samples: list[tuple[int, int, object, object, int, int]]  # sample id, source row, ids, mask, offset, length
    host: dict[str, np.ndarray]  # numpy views of the slot's buffers, [tokens, ...]
    event: torch.cuda.Event | None


class WritePipeline:
    """Hands captured batches to `writer` on a background thread through `slots` reusable host buffers.

        with WritePipeline(writer, device, slots=3, capacity_tokens=token_budget) as pipe:
            for batch in plan:
                out = capture(ids, lengths)
                pipe.submit(samples, out["hidden"], out.get("topk_ids"), out.get("topk_logprobs"))
            pipe.finalize(stats)

    `samples` is [(batch row, sample id, source row, input_ids, loss_mask)]: the batch rows to store,
    in order, each with its real length len(input_ids) (the rest of the row is padding).  At most `slots`
    batches are between submit() and their last append; their host buffers hold `capacity_tokens` tokens
    each (they grow if a batch needs more).
    """

    def __init__(self, writer: ShardWriter, device, slots: int = 3, capacity_tokens: int = 0):
        if slots < 1:
            raise ValueError("a write pipeline needs at least one slot")
        self.writer = writer
        self._committed_ids = writer.committed_sample_ids()  # read before the writer thread owns it
        self.device = torch.device(device)
        self.capacity_tokens = int(capacity_tokens)
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._free: queue.Queue[_Slot] = queue.Queue()
        for _ in range(slots):
            self._free.put(_Slot(cuda, self.device))
        self.slots = slots
        self._work: queue.Queue[_Item | None] = queue.Queue(maxsize=slots)
        self._error: BaseException | None = None
        self._reported = False
        self._closed = False
        self.in_flight_max = 0  # most slots out of the pool at once (tests: never more than `slots`)
        self.stall_s = 0.0  # time submit() waited for a free slot: the GPU waiting for the store
        self._thread = threading.Thread(target=self._run, name="dflash-store-writer", daemon=True)
        self._thread.start()

    # -- main thread ------------------------------------------------------------------------------

    def submit(self, samples, hidden: torch.Tensor, topk_ids=None, topk_logprobs=None, final_hidden=None) -> None:
        """Queue one right-padded batch ([B, T, L*H] hidden, [B, T, K] top-k, [B, T, H] final hidden when the
        writer stores it, on the device) for writing."""
        self._raise_error()
        if self._closed:
            raise RuntimeError("submit() after the write pipeline was closed")
        if not samples:
            return
        w = self.writer
        meta, off = [], 0
        for b, sid, row, ids, mask in samples:
            meta.append((b, sid, row, ids, mask, off, len(ids)))
            off += len(ids)
        # [B, T, ...] arrays in their stored dtype; per-token work stays on the device (fp8 quantisation);
        # on a CPU, bf16 conversion happens in the copy into the slot (no fresh batch-sized buffer)
        arrays = self._encoded(hidden, w.num_layers)
        if w.final_hidden:
            if final_hidden is None:
                raise ValueError("this shard stores the final hidden state: submit the capture's final_hidden too")
            arrays.update(final_named(self._encoded(final_hidden, 1)))
        hidden_bits = torch.bfloat16 if w.hidden_dtype == "bf16" else torch.uint8
        dtypes = {"hidden": hidden_bits, "final_hidden": hidden_bits}
        if w.topk:
            arrays["topk_ids"], arrays["topk_logprobs"] = topk_ids.to(torch.int32), topk_logprobs.float()
        slot = self._take_slot()
        try:
            if self._stream is not None:
                self._stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._stream):
                    host = self._copy(slot, arrays, dtypes, meta, off)
                    for t in arrays.values():
                        t.record_stream(self._stream)  # the allocator keeps t until the copies are done
                    slot.event.record(self._stream)
            else:
                host = self._copy(slot, arrays, dtypes, meta, off)
        except BaseException:
            self._free.put(slot)
            raise
        self._enqueue(_Item(slot, [(sid, row, ids, mask, o, n) for _, sid, row, ids, mask, o, n in meta], host, slot.event))

    def _encoded(self, h: torch.Tensor, num_layers: int) -> dict[str, torch.Tensor]:
        if self.writer.hidden_dtype == "fp8":
            return encode_hidden_tensors(h, "fp8", num_layers)
        return {"hidden": h.to(torch.bfloat16) if self._stream is not None else h}

    def _enqueue(self, item: _Item) -> None:
        self._work.put(item)

    def committed_sample_ids(self) -> set[int]:
        """The shard's committed samples when the pipeline started (what a resumed run skips)."""
        return set(self._committed_ids)

    def _copy(self, slot: _Slot, arrays, dtypes, meta, total: int) -> dict[str, np.ndarray]:
        """Each sample's real rows into the slot, packed (padding never leaves the device)."""
        host = {}
        cuda = self._stream is not None
        for name, t in arrays.items():
            dtype = dtypes.get(name, t.dtype)
            dst = slot.view(name, dtype, (total, *t.shape[2:]), self.capacity_tokens)
            for b, _, _, _, _, o, n in meta:
                dst[o : o + n].copy_(t[b, :n], non_blocking=cuda)
            host[name] = (dst.view(torch.int16) if dtype == torch.bfloat16 else dst).numpy()
        return host

    def _take_slot(self) -> _Slot:
        t0 = time.perf_counter()
        while True:
            try:
                slot = self._free.get(timeout=0.2)
                break
            except queue.Empty:
                self._raise_error()
                if not self._thread.is_alive():
                    raise RuntimeError("the store writer thread has stopped") from None
        self.stall_s += time.perf_counter() - t0
        self.in_flight_max = max(self.in_flight_max, self.slots - self._free.qsize())
        if self._error is not None:
            self._free.put(slot)
            self._raise_error()
        return slot

    def _raise_error(self) -> None:
        if self._error is not None and not self._reported:
            self._reported = True
            raise self._error  # the writer thread's own exception (type, message, traceback)

    def _drain(self) -> None:
        """Let the writer thread finish every queued batch and stop; raise its error if it had one."""
        if not self._closed:
            self._closed = True
            self._work.put(None)
        self._thread.join()
        self._raise_error()

    def finalize(self, stats: dict | None = None) -> None:
        """Write everything queued, then finalize the shard (commit, last object, index, complete)."""
        self._drain()
        if self._error is not None:  # already raised once; never finalize past a failure
            raise RuntimeError("the store writer failed earlier; the shard was not finalized")
        self.writer.finalize(stats)

    def close(self) -> None:
        """Write everything queued, then close the writer (which commits what it was given)."""
        try:
            self._drain()
        finally:
            if self._error is None:
                self.writer.close()
            else:  # the writer thread failed: commit nothing more, just stop the I/O threads
                self.writer.abort()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- writer thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # or waiting on the event would make a context on GPU 0
        while True:
            item = self._work.get()
            if item is None:
                return
            try:
                if self._error is None:
                    if item.event is not None:
                        item.event.synchronize()
                    for sid, row, ids, mask, off, n in item.samples:
                        arrays = {name: a[off : off + n] for name, a in item.host.items()}
                        self.writer.append_encoded(sid, row, ids, mask, arrays)
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                self._error = e
            finally:
                item.host = {}
                self._free.put(item.slot)  # its rows were copied into the writer (or dropped)
