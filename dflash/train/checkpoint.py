"""Training checkpoints: written atomically, read without unpickling anything foreign.

    RUN/checkpoints/step-00000100/
        model.safetensors    the drafter only (Qwen3 key names; no target embedding or lm_head), fp32
        config.json          the drafter's HF config (DrafterConfig.to_hf_dict), so export/eval can load it
        train_state.pt       optimizer, scheduler, data position, RNG states: tensors and plain Python
                             values only, read back with torch.load(weights_only=True)
        train_config.json    the TrainConfig and the store's identity, for resume checks and the record

A checkpoint is assembled in a `.tmp-*` directory and moved into place with one os.replace, so a
`kill -9` at any instant leaves either the previous set of checkpoints or the new one, never a torn one.
Its files are made readable by everyone (0644; safetensors writes 0600).  A checkpoint damaged later
(a truncated copy, a full disk under another tool) is named by file: `load_latest` (resume) falls back to
the newest one that reads and says so on stderr; `load_checkpoint` and `check_safetensors` (eval, export)
refuse it.

The training loop does not wait for the disk: `CheckpointWriter` writes each checkpoint on one background
thread (file I/O only, no model code) from a snapshot already in host memory, one at a time.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import sys
import threading
from pathlib import Path

import torch

from dflash.durable import fsync_dir, is_disk_full
from dflash.errors import DFlashError

CHECKPOINTS = "checkpoints"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step-{step:08d}"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary directories are not checkpoints)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def resolve_checkpoint(run_or_checkpoint: str | Path) -> Path:
    """A checkpoint directory, given either itself or a run directory (then: its newest checkpoint)."""
    p = Path(run_or_checkpoint)
    if (p / "model.safetensors").is_file():
        return p
    latest = latest_checkpoint(p)
    if latest is None:
        raise DFlashError(
            f"{p} is neither a checkpoint (model.safetensors + config.json) nor a run directory with "
            f"checkpoints under {p / CHECKPOINTS}; pass the --out directory of a `dflash train` run."
        )
    return latest


FILE_MODE = 0o644


def check_safetensors(path: str | Path) -> None:
    """DFlashError naming `path` when it is missing, truncated or has no readable safetensors header.

    Reads the 8-byte header length and the JSON header only: the data must end exactly where the header's
    last tensor ends, so a file cut short (an interrupted copy, a full disk) is told apart from a sound one."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            raw = f.read(n) if 0 < n <= size - 8 else None
    except FileNotFoundError:
        raise DFlashError(f"{p} is missing; the checkpoint is incomplete.") from None
    except OSError as e:
        raise DFlashError(f"{p} cannot be read ({e}).") from None
    try:
        header = json.loads(raw) if raw is not None else None
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        raise DFlashError(f"{p} is truncated or not a safetensors file ({size} bytes, no readable header).") from None
    need = 8 + n + max(ends, default=0)
    if size != need:
        raise DFlashError(
            f"{p} is truncated: its header describes {need} bytes but the file has {size}"
            if size < need else f"{p} is damaged: its header describes {need} bytes but the file has {size}"
        )


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str]) -> None:
    """safetensors' save_file, with the header's `__metadata__` keys in sorted order: safetensors writes them
    in hash-map order, which changes from process to process, so the same tensors would give other bytes."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    with open(path, "rb+") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        if "__metadata__" in header:
            header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        # the same keys and values in another order: as long as the original, or shorter and padded
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) <= n:
            f.seek(8)
            f.write(text.ljust(n, b" "))


def _write_json(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=str)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model_state: dict[str, torch.Tensor],
    drafter_config: dict,
    train_state: dict,
    train_config: dict,
    keep: int = 2,
) -> Path:
    """Write one checkpoint atomically (call on rank 0 only) and prune all but the newest `keep`."""
    final = checkpoint_path(run_dir, step)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model_state.items()}
    try:
        save_safetensors(tensors, tmp / "model.safetensors", {"format": "pt", "step": str(step)})
        with open(tmp / "model.safetensors", "rb+") as f:
            os.fsync(f.fileno())
        _write_json(tmp / "config.json", drafter_config)
        _write_json(tmp / "train_config.json", train_config)
        with open(tmp / "train_state.pt", "wb") as f:
            torch.save(train_state, f)
            f.flush()
            os.fsync(f.fileno())
        for name in ("model.safetensors", "config.json", "train_config.json", "train_state.pt"):
            os.chmod(tmp / name, FILE_MODE)
        fsync_dir(tmp)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # never leave a half-written checkpoint taking the space
        if is_disk_full(e):
            raise DFlashError(
                f"no space left on the device while writing checkpoint {final} (in {tmp}): free space on "
                f"{final.parent} and rerun with --resume; training continues from the previous checkpoint."
            ) from e
        raise
    if final.exists():  # the same step saved again (a resumed run re-reaching it): swap it out whole
        old = final.parent / f".old-{final.name}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(final.parent)
    if keep > 0:
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def host_snapshot(state, device: torch.device):
    """`state` (nested dicts / lists of tensors and plain values) safe to write while training goes on: on a
    GPU the gathered state is already a host copy (cpu_offload); on the CPU it may be the live parameters
    and optimizer moments themselves, so every tensor is copied."""
    if device.type == "cuda":
        return state
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: t.detach().clone(), state)


class CheckpointWriter:
    """save_checkpoint on a background thread, one checkpoint at a time: `save` waits for the previous write,
    then starts this one and returns; `wait` (the run's end, or before the next save) joins it and raises its
    error, if any (a full disk: save_checkpoint's DFlashError).  The arguments must not change while written:
    pass a host_snapshot."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.written: list[Path] = []

    def save(self, *args, **kwargs) -> None:
        self.wait()

        def write():
            try:
                self.written.append(save_checkpoint(*args, **kwargs))
            except BaseException as e:  # raised in the training thread by wait()
                self._error = e

        self._thread = threading.Thread(target=write, name="dflash-checkpoint-writer")
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            raise e


def clean_partial(run_dir: str | Path) -> None:
    """Remove leftovers of a checkpoint write interrupted by a crash."""
    root = Path(run_dir) / CHECKPOINTS
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith((".tmp-", ".old-")):
                shutil.rmtree(p, ignore_errors=True)


def load_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict, dict, dict]:
    """(model_state, drafter_config, train_state, train_config) of one checkpoint directory."""
    from safetensors.torch import load_file

    p = Path(path)
    try:
        check_safetensors(p / "model.safetensors")
    except DFlashError as e:
        raise DFlashError(f"checkpoint {p} cannot be read: {e} Delete {p} to resume from the previous "
                          "checkpoint.") from None
    try:
        model_state = load_file(str(p / "model.safetensors"))
        drafter_config = json.loads((p / "config.json").read_text())
        train_config = json.loads((p / "train_config.json").read_text())
        train_state = torch.load(p / "train_state.pt", map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - OSError, ValueError, RuntimeError, pickle and safetensors errors
        raise DFlashError(
            f"checkpoint {p} cannot be read ({type(e).__name__}: {e}); delete it to resume from the previous one."
        ) from None
    return model_state, drafter_config, train_state, train_config


def arch_change(checkpoint: Path, saved: dict, now: dict) -> str | None:
    """Why a run cannot resume `checkpoint` when its drafter config `saved` and this run's `now` (both
    to_hf_dict form) differ in family or in the family's own shape; None when they do not."""
    from dflash.drafter import family_of_hf

    def arch(d):
        f = family_of_hf(d)
        return f.name if f is not None else (d.get("architectures") or ["?"])[0]

    def knobs(d):
        dc, f = d.get("dflash_config") or {}, family_of_hf(d)
        return {k: dc[k] for k in (f.knobs if f is not None else ()) if k in dc}

    if arch(saved) != arch(now):
        return (f"checkpoint {checkpoint} holds a {arch(saved)} drafter and this run asks for --arch {arch(now)}: "
                f"their weights differ in kind; resume with --arch {arch(saved)} or start a new --out directory.")
    if knobs(saved) != knobs(now):
        return (f"checkpoint {checkpoint} is a {arch(saved)} drafter with {knobs(saved)} and this run asks for "
                f"{knobs(now)}; resume with the checkpoint's options or start a new --out directory.")
    return None


def load_latest(run_dir: str | Path) -> tuple[Path, tuple] | None:
    """(path, load_checkpoint(path)) of the newest checkpoint that reads, or None when the run has none.

    A newer one that does not read (truncated, half-deleted) is skipped with a note on stderr naming it
    and why; it is left in place for the user to inspect (the next save of that step replaces it whole).
    DFlashError when checkpoints exist and none reads."""
    found = list_checkpoints(run_dir)
    problems = []
    for p in reversed(found):
        try:
            loaded = load_checkpoint(p)
        except DFlashError as e:
            problems.append(str(e))
            print(f"warning: skipping checkpoint {p}: {e}", file=sys.stderr, flush=True)
            continue
        if problems:
            print(f"warning: resuming from the previous complete checkpoint {p} instead.", file=sys.stderr, flush=True)
        return p, loaded
    if problems:
        raise DFlashError(f"no checkpoint of {run_dir} can be read ({'; '.join(problems)}); start a new run "
                          "(another --out, or --overwrite).")
    return None


__all__ = [
    "CHECKPOINTS",
    "checkpoint_path",
    "list_checkpoints",
    "latest_checkpoint",
    "resolve_checkpoint",
    "save_checkpoint",
    "clean_partial",
    "load_checkpoint",
    "load_latest",
    "check_safetensors",
    "save_safetensors",
]
