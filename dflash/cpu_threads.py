"""How a CPU process of a stage computes: how many intra-op threads it takes, and deterministic kernels."""

from __future__ import annotations

import os


def cpu_threads(processes: int) -> int:
    """The cores shared out among `processes` processes of one stage, unless the user fixed the count.

    An explicit OMP_NUM_THREADS wins (torchrun sets it to 1 for several processes a node, and a user running
    beside other work sets it on purpose): several processes each taking every core oversubscribe the
    machine, and OpenMP's waiting threads then spin on cores the others need.
    """
    explicit = os.environ.get("OMP_NUM_THREADS", "").strip()
    if explicit.isdigit() and int(explicit) > 0:
        return int(explicit)
    return max(1, (os.cpu_count() or 1) // max(1, processes))


def deterministic_kernels(on: bool = True):
    """Kernels that give the same bits run after run, so that a CPU training run's checkpoints are a function
    of its inputs (dvc.lock then holds their hashes once and for all).  Without it, some of the backward's
    CPU kernels accumulate in parallel in an order that changes from run to run, and two runs' weights part
    in their last bits after a few steps.  warn_only: an op with no deterministic CPU kernel warns instead
    of stopping a run.  torch.empty's NaN fill, which the mode turns on, is left off: it only matters to
    code that reads memory it never wrote, and costs a pass over every new tensor.

    Returns a callable that puts the previous settings back (a run in the caller's process leaves its
    process as it found it)."""
    import torch
    import torch.utils.deterministic

    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.utils.deterministic.fill_uninitialized_memory)

    def restore() -> None:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.utils.deterministic.fill_uninitialized_memory = before[2]

    if on:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = False
    return restore
