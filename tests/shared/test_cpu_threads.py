"""dflash.cpu_threads: an explicit OMP_NUM_THREADS wins; otherwise the cores are shared out."""

from __future__ import annotations

import os

from dflash.cpu_threads import cpu_threads


def test_explicit_omp_num_threads_wins(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads(1) == 3 and cpu_threads(8) == 3


def test_cores_are_shared_out_without_it(monkeypatch):
    cores = os.cpu_count() or 1
    for unset in (None, "", "0", "abc"):  # unset, empty or not a count: the user fixed nothing
        if unset is None:
            monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        else:
            monkeypatch.setenv("OMP_NUM_THREADS", unset)
        assert cpu_threads(1) == cores
        assert cpu_threads(2) == max(1, cores // 2)
        assert cpu_threads(10 * cores) == 1  # never none
