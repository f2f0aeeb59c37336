"""Test-only plugin: on a `dflash` subprocess's PYTHONPATH (tests/processes.py `slow_writes`), every batch a
precompute shard writes takes DFLASH_SLOW_WRITES_S seconds longer, so that a test's SIGKILL can land
mid-run.  Python imports sitecustomize at the start of every process of the run, the spawned shards
included; the shard module is wrapped as it is imported, and product code knows nothing of it."""

from __future__ import annotations

import importlib.abc
import os
import sys
import time

MODULE = "dflash.precompute.shard"
DELAY_S = float(os.environ.get("DFLASH_SLOW_WRITES_S", "0") or 0)


class _SlowWrites(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_slowed(module):
            exec_module(module)
            write = module._write_batch

            def slow_write_batch(*args, **kwargs):
                write(*args, **kwargs)
                time.sleep(DELAY_S)

            module._write_batch = slow_write_batch

        spec.loader.exec_module = exec_slowed
        return spec


if DELAY_S > 0:
    sys.meta_path.insert(0, _SlowWrites())
