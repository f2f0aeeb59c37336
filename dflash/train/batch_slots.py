"""BatchSlots: reusable shared, page-locked buffers for the context features of training micro-batches.

Why: a DataLoader worker otherwise builds each micro-batch's context features (~670 MB at Qwen3-8B width,
4 rows of 4096 tokens) in a fresh shared-memory segment.  The training process then maps it, the
DataLoader's pin-memory thread copies it into page-locked memory, and the segment is unmapped and its
pages freed when the batch is dropped, in the pin-memory thread with the GIL held, so that thread
competes with the training thread for the GIL.  Page-locked memory grows with the micro-batches in
flight (workers x 4).  With slots the pin-memory thread rarely takes the GIL, host memory is bounded by
the number of slots and one host copy per micro-batch is gone; the step itself did not get faster (it
was not held back by that GIL).

Here the training process makes `num_slots` buffers once, in shared memory, page-locked with
cudaHostRegister on a GPU.  Workers attach to them at start (the DataLoader hands them the dataset, and
with it the buffers, by file descriptor) and read the store straight into a slot; the batch that crosses
the process boundary carries only the slot number.  The host-to-device copy then runs from pinned memory
with no intermediate copy, and no memory is mapped, pinned or freed per batch.

Hand-over protocol, one counter per slot (`next_seq`, shared): micro-batch number `seq` (its position in
this loader's order) uses slot `seq % num_slots` once `next_seq[slot] == seq`.  The training process
sets `next_seq[slot] = seq + num_slots` when the slot's contents have been copied out (`release`).  A
worker waiting for a slot polls that counter.  The loader returns batches in order and the training
process holds at most a few steps' worth, so `num_slots` >= workers + 3 x micro-batches per step cannot
deadlock (see `default_num_slots`).  A worker may wait as long as the trainer is busy (a checkpoint, an
evaluation), but not past the trainer's death: it then raises instead of waiting forever.
"""

from __future__ import annotations

import math
import os
import time

import torch

from dflash.errors import DataError
from dflash.spawned import pid_alive


def default_num_slots(num_workers: int, per_step: int) -> int:
    """Every worker building one batch, the step in use, the next step copying, and one step of slack."""
    return int(num_workers) + 3 * int(per_step) + 1


class BatchSlots:
    """`num_slots` buffers of `slot_bytes` each, shared with DataLoader workers (see the module docstring)."""

    def __init__(self, num_slots: int, slot_bytes: int, pin: bool = False):
        if num_slots < 1 or slot_bytes < 1:
            raise ValueError("BatchSlots needs at least one slot of at least one byte")
        self.num_slots, self.slot_bytes = int(num_slots), int(slot_bytes)
        self.buf = torch.empty(self.num_slots * self.slot_bytes, dtype=torch.uint8).share_memory_()
        self.next_seq = torch.arange(self.num_slots, dtype=torch.int64).share_memory_()
        self._registered = False
        self._owner = os.getpid()  # the training process: workers stop waiting when it is gone
        if pin:
            err = torch.cuda.cudart().cudaHostRegister(self.buf.data_ptr(), self.buf.numel(), 0)
            if int(getattr(err, "value", err)) != 0:
                raise DataError(
                    f"page-locking {self.buf.numel() / 2**30:.1f} GiB of batch slots failed ({err}): lower "
                    "--num-workers or --rows-per-batch, or raise the memory-lock limit (ulimit -l)."
                )
            self._registered = True

    def __getstate__(self):  # workers get the shared buffers, never the registration
        return {"num_slots": self.num_slots, "slot_bytes": self.slot_bytes, "buf": self.buf,
                "next_seq": self.next_seq, "_registered": False, "_owner": self._owner}

    def view(self, slot: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        need = math.prod(shape) * dtype.itemsize
        if need > self.slot_bytes:
            raise DataError(f"a micro-batch of shape {tuple(shape)} ({need} bytes) does not fit a batch slot "
                            f"({self.slot_bytes} bytes); this is a bug: slots are sized from the largest shape")
        lo = slot * self.slot_bytes
        return self.buf[lo : lo + need].view(dtype).view(shape)

    def fits(self, shape: tuple, dtype: torch.dtype) -> bool:
        return math.prod(shape) * dtype.itemsize <= self.slot_bytes

    def acquire(self, seq: int) -> int:
        """In a worker: wait until micro-batch `seq` may use its slot; returns the slot."""
        slot = seq % self.num_slots
        checked = time.monotonic()
        while int(self.next_seq[slot]) != seq:
            if int(self.next_seq[slot]) > seq:
                raise DataError(f"batch slot {slot} was handed to micro-batch {int(self.next_seq[slot])} before "
                                f"micro-batch {seq}; this is a bug in the loader's order")
            if time.monotonic() - checked > 0.1:
                if not pid_alive(self._owner):
                    raise DataError(f"the training process {self._owner} is gone (micro-batch {seq} was waiting "
                                    "for its batch slot)")
                checked = time.monotonic()
            time.sleep(0.0005)
        return slot

    def release(self, seq: int) -> None:
        """In the training process, once micro-batch `seq`'s contents have been copied out of its slot."""
        self.next_seq[seq % self.num_slots] = seq + self.num_slots

    def reset(self) -> None:
        """For a new loader (its micro-batches numbered from 0), once every slot of the last one is released."""
        self.next_seq.copy_(torch.arange(self.num_slots, dtype=torch.int64))

    def close(self) -> None:
        if self._registered:
            torch.cuda.synchronize()  # no copy may still read the slots
            torch.cuda.cudart().cudaHostUnregister(self.buf.data_ptr())
            self._registered = False


__all__ = ["BatchSlots", "default_num_slots"]
