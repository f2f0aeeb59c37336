"""A run's step bookkeeping: step times, recompiles, and each step's metrics record, read one step late.

The training loop opens a `StepTracker` with what it reads: the step's host clock, the data-wait and GC
timers, the run's config and device.  `begin` and `end` bracket each step (`end` is handed the step's
statistics and position) and `flush` writes the previous one's record, so that the only host sync of a
step waits for a step the GPU has already finished.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from dflash.config import TrainConfig
from dflash.train.metrics import RunLogger, step_record
from dflash.train.step import HOST_PHASES, StepStats, compile_count


@dataclasses.dataclass
class PendingStep:
    """A finished step whose statistics are still on the device: read one step late, so that the host's
    only sync of a step never makes the GPU wait for the host."""

    stats: torch.Tensor  # StepStats vector (pinned host copy on a GPU, in flight)
    event: torch.cuda.Event | None  # recorded after the step: its end on the device's timeline
    step: int
    epoch: int
    epoch_samples: int  # samples the epoch's plan covers
    lr: float
    dt: float  # host seconds since the previous step ended
    data_wait: float
    gc: float
    recompiles: int
    host: dict  # host seconds per HOST_PHASES entry in this step


class StepTracker:
    """Step timing, recompiles and the deferred metrics records (PendingStep) of a run."""

    def __init__(self, cfg: TrainConfig, device: torch.device, logger: RunLogger | None, total: int, *, host: dict,
                 data_wait_s: Callable[[], float], gc_s: Callable[[], float], since: float | None = None):
        """host: the step's seconds per HOST_PHASES entry, summed over steps (TrainStep.host; `flush` adds
        its sync wait there); data_wait_s / gc_s: the seconds waited for data and spent in GC so far."""
        self.cfg, self.device, self.logger, self.total = cfg, device, logger, total
        self.host, self.data_wait_s, self.gc_s = host, data_wait_s, gc_s
        self.compiles0, self.recompiles = compile_count(), 0
        self.t_last = since or time.perf_counter()
        self.first_wait0: float | None = 0.0 if since else None
        self.host_last = dict(host)
        self.tokens, self.seconds = 0, 0.0
        self.pending: PendingStep | None = None
        self.last_event = None

    def begin(self) -> None:
        self.wait0, self.gc0 = self.data_wait_s(), self.gc_s()
        if self.first_wait0 is not None:  # the first step: its data wait since the data was opened
            self.wait0, self.first_wait0 = self.first_wait0, None

    def end(self, stats: torch.Tensor, step: int, epoch: int, epoch_samples: int, lr: float, *,
            counts_recompiles: bool, compiles_before: int) -> None:
        """The step just run: its StepStats vector (on the device), its number, epoch, the samples of the
        epoch's plan and its learning rate."""
        host = self.host
        if counts_recompiles:
            self.recompiles += compile_count() - compiles_before
        now = time.perf_counter()
        dt, self.t_last = now - self.t_last, now
        phases, self.host_last = {k: host[k] - self.host_last[k] for k in HOST_PHASES}, dict(host)
        event = None
        if self.device.type == "cuda":
            on_device, stats = stats, torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
            stats.copy_(on_device, non_blocking=True)
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.flush()  # the previous step: its sync wait falls in this step's host interval, counted there
        self.pending = PendingStep(stats, event, step, epoch, epoch_samples, lr, dt, self.data_wait_s() - self.wait0,
                                   self.gc_s() - self.gc0, self.recompiles, phases)

    def flush(self, extra: dict | None = None) -> None:
        """Log the pending step, if any (the only host sync of a step)."""
        p, self.pending = self.pending, None
        if p is None:
            return
        device_dt = None
        if p.event is not None:
            t0 = time.perf_counter()
            p.event.synchronize()
            self.host["sync"] += time.perf_counter() - t0
            # The step on the device's timeline, end of the previous step to end of this one: the host
            # runs ahead of the GPU by up to a step, so host intervals swing widely.
            if self.last_event is not None:
                device_dt = self.last_event.elapsed_time(p.event) / 1e3
            self.last_event = p.event
        stats = StepStats.from_vector(p.stats.tolist(), self.cfg.drafter.block_size)
        rec = step_record(p, stats, device_dt, self.cfg, self.device, compile_count() - self.compiles0)
        rec.update(extra or {})
        if p.step > 1 or self.total == 1:
            self.tokens, self.seconds = self.tokens + rec["ctx_tokens"], self.seconds + p.dt
        if self.logger:
            self.logger.log(rec)

    def restart_clock(self) -> None:
        """Work between two steps (a held-out eval, a checkpoint) is not the next step's: without this its
        seconds, tens on a first eval that compiles its shapes, land in that step's rates. Their own
        seconds are in the eval's record (`eval_s`, `eval_walk_s`)."""
        self.t_last = time.perf_counter()
        self.last_event = None  # the next step's rates then come from the host's clock, which starts here

    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


__all__ = ["PendingStep", "StepTracker"]
