"""ProcessWritePipeline: the WritePipeline with its ShardWriter in a process of its own.

Why a process: WritePipeline's writer thread shares the GIL with the thread that drives the GPU.
Zarr's asyncio machinery, numpy and the commit bookkeeping hold the GIL often enough to slow the
target's forward, which Python launches op by op: a capture runs measurably slower beside a writer
thread doing a precompute's writes, and at full speed beside a writer process doing the same
(bench/precompute_bench.py, passes capture_bg_thread / capture_bg_process;
benchmarks/precompute-qwen3-8b-h200-2026-11-30.md).

    main process: GPU thread           main process: "dflash-store-handoff"    writer process
    submit(): encode on the device,    waits for the copy's CUDA event, then    ShardWriter.append_encoded
    copy the real rows into a shared   sends the batch's metadata (slot,        per sample (copies out of
    slot (pinned: cudaHostRegister)    sample ids, token ids, masks)            the slot), commits; sends
    on a side stream, record an event                                           the slot back
                                       "dflash-store-receiver": slots back,
                                       errors, the end

The slots are shared-memory tensors handed to the child once, at start; nothing but metadata crosses
the queues afterwards (pickled by multiprocessing between a process and its own child: no trust
boundary is crossed).  The helper threads only wait on events and queues: no model, no compiled code,
no masks off the main thread (the project's rule), and almost no GIL.

Semantics are WritePipeline's: batches are appended in submit() order; at most `slots` are in flight;
finalize(stats) writes everything and finalizes the shard; close() commits what was given.  The writer
process opens the shard itself (resume: `committed_sample_ids()` comes from it) and dies with its
parent (PR_SET_PDEATHSIG on Linux, and a check of its parent between batches), so `kill -9` of a shard
process leaves only committed state.  An error in the writer process comes back as a
StoreError naming the original exception and its traceback, at the next submit()/finalize()/close().
"""

from __future__ import annotations

import math
import os
import queue
import resource
import threading
import traceback
from types import SimpleNamespace

import numpy as np
import torch
import torch.multiprocessing as mp

from dflash.errors import StoreError
from dflash.spawned import die_with_parent
from dflash.store import layout
from dflash.store.pipeline import WritePipeline, _Slot

START_TIMEOUT_S = 300  # the writer process imports torch and zarr and opens the shard (resume included)


class _SharedSlot(_Slot):
    """A _Slot whose buffers are shared-memory tensors of a fixed capacity (the child holds them too)."""

    def __init__(self, index: int, bufs: dict[str, torch.Tensor], device: torch.device):
        super().__init__(False, device)
        self.index = index
        self.bufs = bufs

    def view(self, name: str, dtype: torch.dtype, shape: tuple, capacity_rows: int) -> torch.Tensor:
        need = math.prod(shape) * dtype.itemsize
        if need > self.bufs[name].numel():
            raise ValueError(f"a batch of {shape[0]} tokens does not fit the write slots ({capacity_rows} tokens); "
                             "this is a bug: the slots are sized from the token budget and the maximum length")
        return self.bufs[name][:need].view(dtype).view(shape)


def _row_bytes(hidden_dtype: str, hidden_width: int, num_layers: int, topk: int, final_hidden: bool) -> dict[str, int]:
    """Bytes per token that submit() copies into a slot, by array (ids and masks travel as metadata)."""
    specs = layout.array_specs(hidden_dtype, hidden_width, num_layers, topk, final_hidden)
    return {name: dt.itemsize * math.prod(row) for name, (dt, row) in specs.items()
            if name not in ("input_ids", "loss_mask")}


class ProcessWritePipeline(WritePipeline):
    """WritePipeline's interface; the ShardWriter(**writer_args) lives in a child process."""

    def __init__(self, writer_args: dict, device, slots: int = 3, capacity_tokens: int = 0):
        if slots < 1:
            raise ValueError("a write pipeline needs at least one slot")
        if capacity_tokens < 1:
            raise ValueError("a process write pipeline needs its slots' capacity in tokens")
        self.device = torch.device(device)
        self.capacity_tokens = int(capacity_tokens)
        a = writer_args
        self.writer = SimpleNamespace(hidden_dtype=a.get("hidden_dtype", "bf16"), num_layers=int(a["num_layers"]),
                                      topk=int(a.get("topk", 0)), final_hidden=bool(a.get("final_hidden")))
        w = self.writer
        rows = _row_bytes(w.hidden_dtype, int(a["hidden_width"]), w.num_layers, w.topk, w.final_hidden)
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._registered: list[int] = []
        shared = []
        for _ in range(slots):
            bufs = {}
            for name, row_bytes in rows.items():
                t = torch.empty(self.capacity_tokens * row_bytes, dtype=torch.uint8).share_memory_()
                if cuda:  # page-locked, so that the device-to-host copies run asynchronously
                    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
                    if int(getattr(err, "value", err)) != 0:
                        self._unregister()
                        raise StoreError(f"cudaHostRegister of a {t.numel() / 2**20:.0f} MiB write slot failed ({err}); "
                                         "lower --token-budget or use --writer thread.")
                    self._registered.append(t.data_ptr())
                bufs[name] = t
            shared.append(bufs)
        self._slots = [_SharedSlot(i, bufs, self.device) for i, bufs in enumerate(shared)]
        self._free: queue.Queue = queue.Queue()
        for s in self._slots:
            self._free.put(s)
        self.slots = slots
        self._error: BaseException | None = None
        self._reported = self._closed = False
        self.in_flight_max = 0
        self.stall_s = 0.0
        ctx = mp.get_context("spawn")  # never fork a process that holds a CUDA context
        self._cmd, self._back = ctx.Queue(), ctx.Queue()
        self._proc = ctx.Process(target=_writer_main, args=(dict(a), shared, self._cmd, self._back, os.getpid()),
                                 name="dflash-store-writer", daemon=True)
        self._proc.start()
        kind, payload = self._wait_ready()
        if kind != "ready":
            self._proc.join(10)
            self._unregister()
            raise _child_error(payload) if kind == "error" else StoreError(f"the store writer process did not start: {payload}")
        self._committed_ids = set(payload)
        self._done = threading.Event()
        self._handoff: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=self._handoff_loop, name="dflash-store-handoff", daemon=True),
                         threading.Thread(target=self._receive_loop, name="dflash-store-receiver", daemon=True)]
        for t in self._threads:
            t.start()
        self._thread = self._threads[1]  # _take_slot checks that the receiver is alive
        self._finished = False

    # -- main thread ------------------------------------------------------------------------------

    def _enqueue(self, item) -> None:
        layout_ = {name: (a.dtype.str, a.shape[1:]) for name, a in item.host.items()}
        self._handoff.put((item.event, ("batch", item.slot.index, item.samples, layout_)))

    def finalize(self, stats: dict | None = None) -> None:
        """Write everything queued, then finalize the shard in the writer process."""
        self._finish(("finalize", stats or {}))
        if self._error is not None:
            raise RuntimeError("the store writer failed earlier; the shard was not finalized")

    def close(self) -> None:
        """Write everything queued and commit it (nothing more after an error), then stop the process."""
        self._finish(("close",))

    def _finish(self, command) -> None:
        if self._finished:
            self._raise_error()
            return
        self._finished = self._closed = True
        try:
            self._handoff.put(None)
            self._threads[0].join()
            if self._error is None:
                self._cmd.put(command)
            while not self._done.wait(0.2):
                if not self._proc.is_alive() and not self._threads[1].is_alive():
                    break
            # After "done" the shard is closed and durable; the child's interpreter teardown (slow with
            # torch loaded) need not be waited for: multiprocessing reaps it later.
            self._proc.join(0.05 if self._error is None and self._done.is_set() else 60)
            if self._proc.is_alive() and not self._done.is_set():
                self._proc.kill()
                self._proc.join(10)
        finally:
            self._threads[1].join(5)
            self._unregister()
        self._raise_error()

    def _unregister(self) -> None:
        for ptr in self._registered:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        self._registered = []

    def _wait_ready(self):
        """The child's first message, or why there is none (it exited, or took too long)."""
        waited = 0.0
        while waited < START_TIMEOUT_S:
            try:
                return self._back.get(timeout=0.2)
            except queue.Empty:
                waited += 0.2
                if not self._proc.is_alive():
                    return "exited", f"it exited with code {self._proc.exitcode} (its stderr says why)"
        return "timeout", f"no answer within {START_TIMEOUT_S}s"

    # -- helper threads (no torch work beyond waiting on an event) -----------------------------------

    def _handoff_loop(self) -> None:
        if self._stream is not None:
            torch.cuda.set_device(self.device)  # or waiting on the event would make a context on GPU 0
        while True:
            job = self._handoff.get()
            if job is None:
                return
            event, msg = job
            if self._error is not None:
                continue  # the writer failed: later batches are dropped (the store keeps a prefix)
            if event is not None:
                event.synchronize()  # the copies into the slot are done
            self._cmd.put(msg)

    def _receive_loop(self) -> None:
        while True:
            try:
                kind, payload = self._back.get(timeout=0.5)
            except queue.Empty:
                if not self._proc.is_alive():
                    if not self._done.is_set() and self._error is None:
                        self._error = StoreError(f"the store writer process exited (code {self._proc.exitcode}) "
                                                 "before the shard was closed; rerun to resume the shard.")
                    self._done.set()
                    return
                continue
            if kind == "free":
                self._free.put(self._slots[payload])
            elif kind == "error":
                self._error = _child_error(payload)
                self._release_all()
            elif kind == "done":
                self._done.set()
                return

    def _release_all(self) -> None:
        """After an error no slot comes back: free them all so that submit() reaches the error."""
        for s in self._slots:
            self._free.put(s)


def _child_error(payload) -> StoreError:
    kind, message, tb = payload
    if kind == "StoreError":  # a user error (a full disk, a damaged shard): its message says what to do
        e = StoreError(message)
        e.worker_traceback = tb
        return e
    return StoreError(f"the store writer process failed with {kind}: {message}\n--- in the writer process:\n{tb}")


# -- the writer process ---------------------------------------------------------------------------------


def _writer_main(writer_args: dict, shared: list[dict], cmd, back, parent_pid: int) -> None:
    die_with_parent(parent_pid)  # kill -9 of a shard process takes its writer too
    torch.set_num_threads(1)
    try:
        from dflash.store.writer import ShardWriter

        w = ShardWriter(**writer_args)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        back.put(("error", (type(e).__name__, str(e), traceback.format_exc())))
        return
    back.put(("ready", sorted(w.committed_sample_ids())))
    views = [{name: t.numpy() for name, t in bufs.items()} for bufs in shared]
    try:
        while True:
            try:
                msg = cmd.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent_pid:
                    os._exit(1)  # orphaned: stop without committing anything more
                continue
            if msg[0] == "batch":
                _, i, samples, layout_ = msg
                arrays_of = {name: _typed(views[i][name], dt, row) for name, (dt, row) in layout_.items()}
                for sid, row, ids, mask, off, n in samples:
                    w.append_encoded(sid, row, ids, mask, {name: a[off : off + n] for name, a in arrays_of.items()})
                back.put(("free", i))
            else:  # finalize or close: everything is written, fsynced and committed when this returns
                if msg[0] == "finalize":
                    w.finalize({**msg[1], "writer_cpu_s": _cpu_s()})
                w.close()
                back.put(("done", None))
                return
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        back.put(("error", (type(e).__name__, str(e), traceback.format_exc())))
        w.abort()


def _cpu_s() -> dict[str, float]:
    """This process's CPU seconds so far (user, system): the writer's load beside its wall time."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return {"user": round(r.ru_utime, 3), "sys": round(r.ru_stime, 3), "minor_faults": r.ru_minflt}


def _typed(buf: np.ndarray, dtype: str, row: tuple) -> np.ndarray:
    """The slot's flat bytes as [tokens, *row] of `dtype` (the packed rows of one batch start at 0)."""
    a = buf.view(np.dtype(dtype))
    per = math.prod(row)
    return a[: (len(a) // per) * per].reshape(-1, *row)


__all__ = ["ProcessWritePipeline"]
