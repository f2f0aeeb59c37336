"""Shared by the crash tests: `dflash` subprocesses killed with SIGKILL at chosen instants, and stores
compared byte for byte."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from dflash.store import open_store

DFLASH = str(Path(sys.executable).with_name("dflash"))
SLOW_WRITES = Path(__file__).with_name("slow_writes")


def slow_writes(seconds: float) -> dict:
    """Environment for a `dflash` subprocess each of whose precompute batches takes `seconds` longer
    (the plugin in tests/slow_writes), so that a kill can land mid-run."""
    return {"PYTHONPATH": os.pathsep.join([str(SLOW_WRITES), os.environ.get("PYTHONPATH", "")]),
            "DFLASH_SLOW_WRITES_S": str(seconds)}


def store_arrays(store) -> dict[int, dict[str, np.ndarray]]:
    s = open_store(store)
    out = {}
    for sid in s.sample_ids():
        r = s.read(sid)
        out[sid] = {k: (v.view(torch.int16) if v.dtype == torch.bfloat16 else v).numpy() for k, v in r.items()}
    return out


def committed(store: Path, shard: str = "shard-00000") -> int:
    """Samples committed so far, from the index segments (each appears by an atomic rename)."""
    import pyarrow as pa

    d = store / shard / "index"
    n = 0
    for f in d.glob("seg-*.arrow") if d.is_dir() else ():
        try:
            with pa.memory_map(str(f)) as src:
                n += pa.ipc.open_file(src).read_all().num_rows
        except (OSError, pa.ArrowInvalid):
            pass  # the writer removed or replaced it meanwhile
    return n


def run_cli(args, env=None, kill_when=None, timeout=120, command="precompute", orphans_s=10):
    """Run `dflash COMMAND ARGS` (precompute by default); with `kill_when`, SIGKILL it (and so its process
    family) as soon as kill_when() is true.  Spawned shard processes notice their launcher's death at their
    next batch (or once their model is loaded): `orphans_s` is how long they may take."""
    p = subprocess.Popen([DFLASH, command, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env={**os.environ, **(env or {})})
    if kill_when is None:
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out.decode(), err.decode()
    t0 = time.time()
    while not kill_when():
        assert p.poll() is None, f"{command} ended before the kill point: {p.communicate()[1].decode()[-2000:]}"
        assert time.time() - t0 < timeout
        time.sleep(0.02)
    family = descendants(p.pid)  # the shard's store writer process among them
    p.send_signal(signal.SIGKILL)
    p.wait()
    p.stdout.close()
    p.stderr.close()
    t0 = time.time()
    while [q for q in family if alive(q)] and time.time() - t0 < orphans_s:
        time.sleep(0.05)
    assert not [q for q in family if alive(q)], f"processes of the killed {command} outlived it"
    return p.returncode, "", str(len(family))  # stderr is not read after a kill: the number of its descendants


def invoke(args, command: str | None = "precompute", cwd=None) -> tuple[int, str, str]:
    """`dflash COMMAND ARGS` (`dflash ARGS` with command None) in this process, through the same click
    command line, run in `cwd` (where a params.yaml would apply) as a subprocess would be: (exit status,
    stdout, stderr), without a new interpreter's start-up.  An exception the command does not turn into its
    one-paragraph message (a traceback on a real command line) is raised here, and fails the test."""
    from click.testing import CliRunner

    from dflash.cli import main

    here = os.getcwd()
    os.chdir(cwd or here)
    try:
        r = CliRunner().invoke(main, [*([command] if command else []), *map(str, args)])
    finally:
        os.chdir(here)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r.exit_code, r.stdout, r.stderr


def descendants(pid: int) -> list[int]:
    parent = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Same:
    """Compares {sample_id: {field: array}} byte for byte, naming the first difference."""

    def __init__(self, ref):
        self.ref = ref

    def __eq__(self, got):
        assert sorted(got) == sorted(self.ref), "sample ids differ"
        for sid, fields in self.ref.items():
            for k, a in fields.items():
                b = got[sid][k]
                assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), f"sample {sid} {k} differs"
        return True
