"""How many intra-op threads a CPU process of a stage takes."""

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
