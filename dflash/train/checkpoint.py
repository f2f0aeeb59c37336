"""Training checkpoints: written atomically, read without unpickling anything foreign.

    RUN/checkpoints/step-00000100/
        model.safetensors    the drafter only (Qwen3 key names; no target embedding or lm_head), fp32
        config.json          the drafter's HF config (DrafterConfig.to_hf_dict), so export/eval can load it
        train_state.pt       optimizer, scheduler, data position, RNG states: tensors and plain Python
                             values only, read back with torch.load(weights_only=True)
        train_config.json    the TrainConfig and the store's identity, for resume checks and the record

A checkpoint is assembled in a `.tmp-*` directory and moved into place with one os.replace, so a
`kill -9` at any instant leaves either the previous set of checkpoints or the new one, never a torn one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

from dflash.errors import DFlashError
from dflash.store.manifest import fsync_dir

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
    from safetensors.torch import save_file

    final = checkpoint_path(run_dir, step)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model_state.items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "step": str(step)})
    with open(tmp / "model.safetensors", "rb+") as f:
        os.fsync(f.fileno())
    _write_json(tmp / "config.json", drafter_config)
    _write_json(tmp / "train_config.json", train_config)
    with open(tmp / "train_state.pt", "wb") as f:
        torch.save(train_state, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
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
        model_state = load_file(str(p / "model.safetensors"))
        drafter_config = json.loads((p / "config.json").read_text())
        train_config = json.loads((p / "train_config.json").read_text())
        train_state = torch.load(p / "train_state.pt", map_location="cpu", weights_only=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise DFlashError(
            f"checkpoint {p} cannot be read ({e}); delete it to resume from the previous one."
        ) from None
    return model_state, drafter_config, train_state, train_config


__all__ = [
    "CHECKPOINTS",
    "checkpoint_path",
    "list_checkpoints",
    "latest_checkpoint",
    "resolve_checkpoint",
    "save_checkpoint",
    "clean_partial",
    "load_checkpoint",
]
