"""`dflash train --gpus 5,6,7 | cpu:N`: one training process per device, started by torch.distributed.

The processes are started with torch.distributed's own elastic launcher (what `torchrun --standalone`
runs), never as threads: torch.compile is not thread-safe.  Under an outside `torchrun` (RANK,
WORLD_SIZE and LOCAL_RANK set) nothing is spawned, this process just trains.  One device means no
launcher at all: the training runs in this process.

Preflight runs here, once, before any process starts (a bad store or run directory should cost a
message, not N stack traces); each training process receives its `ResolvedRun` as an argument
(dflash.train.resolved; under torchrun rank 0 resolves it and broadcasts it).  A DFlashError raised
inside a training process is carried back to this process through a file and re-raised with its message.

This process (the launcher, or rank 0 under torchrun) holds the run directory's lock (dflash/locks.py)
for the whole run, taken before preflight: one trainer per --out.  The launcher's rendezvous is on
loopback (127.0.0.1): a single-node run needs no reachable host name.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from dflash.config import TrainConfig
from dflash.errors import ConfigError, DFlashError, out_of_memory, out_of_memory_message

if TYPE_CHECKING:
    from dflash.train.resolved import ResolvedRun

LOOPBACK = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class Devices:
    kind: str  # "cuda" | "cpu"
    ids: tuple[int, ...]  # CUDA device ids, or range(N) for cpu:N

    @property
    def count(self) -> int:
        return len(self.ids)


def parse_gpus(spec: str) -> Devices:
    """'5,6,7' -> cuda (5, 6, 7); 'cpu:N' / 'cpu' -> N CPU processes; 'auto' -> all GPUs, else cpu:1."""
    s = (spec or "").strip().lower().replace(" ", "")
    if s in ("", "auto"):
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return Devices("cuda", tuple(range(n))) if n else Devices("cpu", (0,))
    if s == "cpu" or s.startswith("cpu:"):
        n = s.split(":", 1)[1] if ":" in s else "1"
        if not n.isdigit() or int(n) < 1:
            raise ConfigError(f"--gpus {spec!r}: write cpu:N with N >= 1 processes, e.g. --gpus cpu:2.")
        return Devices("cpu", tuple(range(int(n))))
    parts = [p for p in s.split(",") if p]
    if not parts or not all(p.isdigit() for p in parts):
        raise ConfigError(f"--gpus {spec!r}: give comma-separated GPU ids (e.g. 5,6,7) or cpu:N (e.g. cpu:2).")
    ids = tuple(int(p) for p in parts)
    if len(set(ids)) != len(ids):
        raise ConfigError(f"--gpus {spec!r} lists a GPU twice; each process needs its own GPU.")
    return Devices("cuda", ids)


def check_devices(devices: Devices) -> None:
    if devices.kind != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            f"--gpus {','.join(map(str, devices.ids))} asks for GPUs but CUDA is not available in this "
            f"environment (torch {torch.__version__}); run on CPU with --gpus cpu:N (e.g. --gpus cpu:2)."
        )
    n = torch.cuda.device_count()
    bad = [i for i in devices.ids if i >= n]
    if bad:
        raise ConfigError(f"--gpus lists GPU {bad[0]} but only {n} GPU(s) are visible (ids 0..{n - 1}).")


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def _worker(run: ResolvedRun, kind: str, ids: tuple[int, ...], error_dir: str, launcher_pid: int) -> None:
    """Entry point of one launched process (module level: it is pickled to spawned processes)."""
    from dflash.spawned import die_with_parent
    from dflash.train.trainer import run_training

    die_with_parent(launcher_pid)  # the launcher holds the run lock: no training without it

    local_rank = int(os.environ["LOCAL_RANK"])
    try:
        run_training(run, device=_device_for(kind, ids, local_rank))
    except Exception as e:
        if isinstance(e, DFlashError) or out_of_memory(e):  # the launcher says these in one paragraph
            message = str(e) if isinstance(e, DFlashError) else out_of_memory_message("train", e)
            Path(error_dir, f"rank{os.environ.get('RANK', local_rank)}.txt").write_text(message)
        raise


def _device_for(kind: str, ids: tuple[int, ...], local_rank: int) -> str:
    return f"cuda:{ids[local_rank]}" if kind == "cuda" else "cpu"


def launch_train(cfg: TrainConfig) -> dict | None:
    """Train with one process per requested device; returns the final metrics (in this process only
    when it trained itself, i.e. one device or under torchrun)."""
    from dflash.train.trainer import run_training

    if under_torchrun():
        # torchrun started the processes; each one takes the GPU of its local rank (from the --gpus
        # list when it has one per local process).
        devices = parse_gpus(cfg.job.gpus)
        check_devices(devices)
        local_rank = int(os.environ["LOCAL_RANK"])
        ids = devices.ids if devices.kind == "cuda" and local_rank < devices.count else tuple(range(local_rank + 1))
        with run_lock(cfg, os.environ["RANK"] == "0"):  # rank 0 holds the run lock for the whole run
            return run_training(cfg, device=_device_for(devices.kind, ids, local_rank))

    devices = parse_gpus(cfg.job.gpus)
    check_devices(devices)
    with run_lock(cfg):  # before preflight: a second trainer on this --out is refused at once
        return _launch(cfg, devices)


def run_lock(cfg: TrainConfig, holder: bool = True):
    """The run directory's lock (dflash/locks.py): one trainer per --out, also with --resume/--overwrite.
    Held by this process (the launcher, or rank 0 under torchrun), never by the training processes it starts."""
    import contextlib

    if not holder:
        return contextlib.nullcontext()
    if not cfg.job.out:
        raise ConfigError("`dflash train` needs --out (or `out:` in the train section of params.yaml).")
    from dflash.locks import dir_lock

    return dir_lock(cfg.job.out, "run directory", "--out")


def _launch(cfg: TrainConfig, devices: Devices) -> dict | None:
    from dflash.train.preflight import preflight

    return _start(preflight(cfg), devices)


def launch_config(nproc: int):
    """One node, `nproc` local processes.  Rendezvous and the workers' MASTER_ADDR are on loopback
    (127.0.0.1, a free port): a single-node run never listens on, or resolves, the host's public name."""
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"dflash-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"{LOOPBACK}:0",  # a free port, as torchrun --standalone does, but on loopback
        local_addr=LOOPBACK,  # becomes MASTER_ADDR (default: the host's FQDN)
        max_restarts=0,
        monitor_interval=0.2,
        start_method="spawn",
    )


def _start(run: ResolvedRun, devices: Devices) -> dict | None:
    from dflash.train.trainer import run_training

    if devices.count == 1:
        return run_training(run, device=_device_for(devices.kind, devices.ids, 0))

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    launch_cfg = launch_config(devices.count)
    with tempfile.TemporaryDirectory(prefix="dflash-launch-") as error_dir:
        try:
            elastic_launch(launch_cfg, _worker)(run, devices.kind, devices.ids, error_dir, os.getpid())
        except ChildFailedError:
            messages = sorted(Path(error_dir).glob("rank*.txt"))
            if messages:
                raise DFlashError(messages[0].read_text()) from None
            raise
    return None


__all__ = ["Devices", "parse_gpus", "check_devices", "under_torchrun", "launch_train", "launch_config", "run_lock"]
