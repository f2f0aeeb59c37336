"""Python's cyclic garbage collector, kept out of the GPU's way.

Once a model is loaded and torch.compile has run, a process tracks millions of Python objects (modules,
FX graphs, guards, sympy expressions).  CPython's automatic collector walks all of them whenever a full
collection is due, in whichever thread allocated last, holding the GIL: a long pause at some
unpredictable step, longer the more objects set-up left behind.  The GPU idles meanwhile; with several
processes, one rank's pause holds every rank at the next all-reduce.

Two tools, used by training and by precompute:

* `freeze()` after set-up moves every live object into CPython's permanent generation: no collection
  walks them again, so the remaining collections only see what the loop itself allocates.
* `StepGC(every)` turns automatic collection off and collects the young generations every `every`
  steps instead, at the same step in every process (so the pauses line up instead of making stragglers),
  with a full collection only where the loop already pauses (checkpoints).  `every=0` leaves CPython's
  automatic collector on (the behaviour before).

`GcTimer` measures the time spent in collections (any generation, any thread): the `gc_frac` metric.
"""

from __future__ import annotations

import gc
import time


class GcTimer:
    """Seconds spent in garbage collections since it started (gc.callbacks: every collection, every
    thread of this process).  Use as a context manager or call close()."""

    def __init__(self):
        self.total_s = 0.0
        self.collections = 0
        self._t0 = None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, _info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.total_s += time.perf_counter() - self._t0
            self.collections += 1
            self._t0 = None

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def freeze() -> float:
    """Collect everything once, then exempt every surviving object from future collections; seconds."""
    t = time.perf_counter()
    gc.collect()
    gc.freeze()
    return time.perf_counter() - t


def unfreeze() -> None:
    gc.unfreeze()


class StepGC:
    """Garbage collection on the training loop's schedule (see the module docstring), and a GcTimer
    (`.timer`) over the same span.  A context manager: leaving it restores CPython's automatic GC."""

    def __init__(self, every: int):
        self.every = int(every)
        self.was_enabled = gc.isenabled()
        self.frozen = False
        self.timer = GcTimer()
        if self.every > 0:
            gc.disable()

    def after_step(self, steps_run: int, warming_up: bool) -> None:
        """Call after each step.  The first call past warm-up (compilation done) freezes what set-up
        built; every `every` steps the young generations are collected."""
        if self.every <= 0:
            return
        if not warming_up and not self.frozen:
            freeze()
            self.frozen = True
        elif steps_run % self.every == 0:
            gc.collect(1)

    def full(self) -> None:
        """A full collection, then freeze again (at checkpoints: the loop pauses there anyway)."""
        if self.every > 0:
            freeze()

    def close(self) -> None:
        self.timer.close()
        if self.every > 0:
            gc.unfreeze()
            if self.was_enabled:
                gc.enable()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


__all__ = ["GcTimer", "StepGC", "freeze", "unfreeze"]
