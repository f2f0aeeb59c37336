"""Micro-batches onto the training device, the next optimizer step's copied while this one computes."""

from __future__ import annotations

import time
from collections import deque

import torch

from dflash.train.batch import MicroBatch


class DeviceFeeder:
    """The micro-batches of one optimizer step at a time, on the training device, the next step's copied
    while the current one computes.

    A packed 4096-token row at Qwen3-8B width carries ~170 MB of context features; copied on the compute
    stream, that copy would sit in front of every step's forward.  Here the copies (from the DataLoader's
    pinned memory) run on a side CUDA stream, issued by `prefetch()` once the current step's first
    micro-batch is queued; `ready(item)` makes the compute stream wait for that micro-batch's copy only.
    Everything runs in the training thread.  On CPU it is a pass-through.  `wait_s` accumulates the time
    spent blocked on the DataLoader (the data-wait metric).

    With `slots` (the loader's dflash.train.batch_slots.BatchSlots), a micro-batch's context features arrive
    as a slot number: they are copied to the device straight from the (pinned) slot, and the slot is
    released, in micro-batch order, once that copy has finished (on CPU: copied out, released at once).
    Context features that arrive as fp8 bits are dequantised by `ready`, on the device."""

    def __init__(self, batches, device: torch.device, per_step: int, slots=None):
        self.it, self.device, self.per_step = iter(batches), device, per_step
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.next = None
        self.wait_s = 0.0
        self.slots = slots
        self._held: deque = deque()  # (seq, copy event or None), oldest first: slots not yet released
        self._fetched = 0

    def _release(self) -> None:
        """Release, in order, the slots whose copies are done; and, whatever it costs, the one the next
        micro-batch needs (its copy is steps old by then), so that its worker never waits on us."""
        need = self._fetched - self.slots.num_slots  # seq whose slot the next micro-batch reuses
        while self._held:
            seq, event = self._held[0]
            if event is not None and not event.query():
                if seq > need:
                    break
                event.synchronize()
            self.slots.release(seq)
            self._held.popleft()

    def _fetch(self) -> list | None:
        items = []
        for _ in range(self.per_step):
            if self.slots is not None:
                self._release()
            t = time.perf_counter()
            try:
                b = next(self.it)
            except StopIteration:
                break
            finally:
                self.wait_s += time.perf_counter() - t
            if self.slots is not None and b.slot is not None:
                host = self.slots.view(b.slot, b.ctx_shape, torch.bfloat16 if b.ctx_scale is None else torch.uint8)
                b.ctx_hidden = host if self.stream is not None else host.clone()
                b.slot = b.ctx_shape = None
            event = None
            if self.stream is not None:
                with torch.cuda.stream(self.stream):
                    b = b.to(self.device, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(self.stream)
            if self.slots is not None:
                self._held.append((b.seq, event))
                b.seq = None
                self._fetched += 1
            items.append((b, event))
        return items or None

    def prefetch(self) -> None:
        if self.next is None:
            self.next = self._fetch()

    def take(self) -> list:
        """This step's micro-batches as opaque items; pass each to ready() right before using it."""
        self.prefetch()
        items, self.next = self.next, None
        if items is None:
            raise StopIteration
        return items

    def close(self, stop_workers: bool = True) -> None:
        """Release every slot still held (their copies finished first) and, unless the loader's next
        iteration is to reuse them, stop its workers."""
        shutdown = getattr(self.it, "_shutdown_workers", None)
        if stop_workers and shutdown is not None:  # an exhausted DataLoader iterator has done this already
            shutdown()
        self.next = None
        while self.slots is not None and self._held:
            seq, event = self._held.popleft()
            if event is not None:
                event.synchronize()
            self.slots.release(seq)

    def ready(self, item) -> MicroBatch:
        b, event = item
        if event is not None:
            main = torch.cuda.current_stream(self.device)
            main.wait_event(event)
            for t in b.tensors():
                t.record_stream(main)  # the allocator must not reuse them while the step uses them
        return b.dequantised()  # fp8 bits: on the compute stream, once their copy is done


__all__ = ["DeviceFeeder"]
