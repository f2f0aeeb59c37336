"""Every knob of every stage, as dataclasses.

Values come from three layers, later ones winning: the dataclass default, the stage's section of
`params.yaml` (`--config`, default `./params.yaml` when present), then flags given on the command line.
Unknown keys in params.yaml are an error (a typo there would otherwise silently do nothing).
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dflash.errors import ConfigError


@dataclass
class PrecomputeConfig:
    target: str = ""  # local directory of an AutoModelForCausalLM checkpoint
    data: str = ""  # json/jsonl/parquet/arrow file(s) or a saved `datasets` directory
    out: str = ""  # store directory
    shards: int = 1  # processes, one per GPU; under torchrun the world size wins
    gpus: str = "auto"  # "auto" (CUDA if present), "cpu", or "0,1,2"
    target_layers: list[int] | None = None  # 0-based; None = DESIGN default for `num_draft_layers`
    num_draft_layers: int = 5  # only used to pick default target layers
    max_length: int = 2048  # longer samples are truncated (and counted)
    topk: int = 8  # stored target top-k log-probs per position; 0 = off
    hidden_dtype: str = "bf16"  # bf16 | fp8
    token_budget: int = 16384  # tokens per forward batch (padded length x rows)
    lm_head_chunk: int = 4096  # positions per lm_head chunk when computing top-k
    commit_every_tokens: int = 32768  # a shard commits (becomes durable, resumable) every N tokens
    store_chunk_tokens: int | None = None  # Zarr inner chunk in tokens (None: ~4 MB of hidden states)
    split: str = "train"  # split to read from a saved DatasetDict
    max_samples: int | None = None  # read only the first N rows (smoke tests)
    dtype: str = "auto"  # target compute dtype: auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    compile: str = "auto"  # torch.compile the top-k log-prob reduction: auto (on for CUDA) | on | off
    writer: str = "process"  # the store's writer: a process of its own (process) or a thread of the shard's (thread)
    trust_remote_code: bool = False
    overwrite: bool = False
    restart_changed: bool = False  # start over (instead of refusing) when the store's inputs changed
    seed: int = 0


@dataclass
class TrainConfig:
    store: str = ""
    target: str = ""  # the target checkpoint: embedding and lm_head are read from it, frozen
    out: str = ""  # run directory
    gpus: str = "cpu:1"  # "5,6,7" (one process per GPU) or "cpu:N" (N gloo processes)
    # drafter shape
    block_size: int = 16
    num_layers: int = 1
    mask_token_id: int | None = None  # None = a spare id of the target's embedding table
    target_layers: list[int] | None = None  # None = the store's; else must equal the store's
    # schedule
    steps: int | None = None  # total optimizer steps; None = derived from epochs
    epochs: float = 1.0
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    grad_accum: int = 1
    # data
    token_budget: int = 4096  # context tokens per packed row
    block_budget: int | None = None  # block (query) tokens per packed row; None = token_budget
    num_shapes: int = 3  # padded S and Q each come from this many multiples of 128 (budget, /2, /4)
    rows_per_batch: int = 1  # packed rows per micro-batch per process
    num_anchors: int = 64  # anchors per sample per epoch (upper bound)
    num_workers: int = 2  # DataLoader worker processes per training process
    balance_steps: bool = True  # each step's micro-batches (one per process) of similar cost (plan._balanced_order)
    batch_slots: bool = True  # context features in reusable shared, page-locked slots (dflash.train.batch_slots)
    seed: int = 0
    # loss
    gamma: float | None = None  # None = 7 for B=16, 5 for B=10, 4 for B=8, else B/2-1
    kd_weight: float = 0.0
    kd_temperature: float = 1.0
    lm_head_chunk: int = 2048  # block positions per lm_head + loss chunk
    # the lm_head chunks' softmax / gradient: triton (dflash.train.loss_kernel, 2x the compiled kernel's speed on an
    # H200; where it cannot run, KD on or no CUDA, it falls back to compiled) | compiled (torch.compile)
    loss_kernel: str = "triton"
    # systems
    parallel: str = "ddp"  # ddp | fsdp
    ddp_overlap: bool = True  # DDP: all-reduce buckets during the backward (compile the wrapper); False: after it
    compile: str = "auto"  # auto (on for CUDA) | on | off
    precision: str = "auto"  # auto (bf16 autocast on CUDA) | bf16 | fp32
    # bookkeeping
    save_every: int = 0  # 0 = only at the end
    keep_checkpoints: int = 2
    log_every: int = 1
    eval_every: int = 0  # offline tau on `eval_store` every N steps; 0 = off
    eval_store: str | None = None
    gc_every: int = 50  # Python GC: young generations every N steps, set-up frozen (dflash.hostgc); 0 = automatic
    profile_steps: int = 0  # torch.profiler over this many steps per process (0 = off): <out>/profile/
    profile_start: int = 5  # ... starting after this many steps of this run (compile and warm-up done)
    resume: bool = False
    overwrite: bool = False


@dataclass
class EvalConfig:
    run: str = ""  # run directory or checkpoint directory
    store: str | None = None  # held-out store: offline tau
    prompts: str | None = None  # held-out conversations: online speculative decoding
    target: str | None = None  # needed online (and when the run does not record it)
    out: str | None = None  # default RUN/eval.json
    plots: bool = True
    max_samples: int | None = None
    max_new_tokens: int = 128
    num_anchors: int = 64
    device: str = "auto"
    dtype: str = "fp32"  # online target + drafter dtype: fp32 keeps the lossless check exact; bf16 = serving speed
    seed: int = 0


@dataclass
class ExportConfig:
    source: str = ""  # run directory or checkpoint directory
    out: str = ""
    check: bool = False
    dtype: str = "bf16"  # weights dtype of the export (bf16 | fp16 | fp32); --check rounds the reference alike


SECTIONS: dict[type, str] = {
    PrecomputeConfig: "precompute",
    TrainConfig: "train",
    EvalConfig: "eval",
    ExportConfig: "export",
}


def _coerce(name: str, tp: Any, value: Any, origin: str) -> Any:
    """Turn a YAML or command-line value into the field's type, or say which key is wrong."""
    if value is None:
        return None
    args = typing.get_args(tp)
    base = typing.get_origin(tp)
    if base is typing.Union or (base is not None and str(base) == "<class 'types.UnionType'>"):
        non_none = [a for a in args if a is not type(None)]
        return _coerce(name, non_none[0], value, origin)
    try:
        if base is list:
            if isinstance(value, str):
                value = [v for v in value.replace(" ", "").split(",") if v]
            return [_coerce(name, args[0], v, origin) for v in value]
        if base is tuple:
            if isinstance(value, str):
                value = value.replace(" ", "").split(",")
            return tuple(_coerce(name, a, v, origin) for a, v in zip(args, value))
        if tp is bool:
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            return bool(value)
        if tp is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if tp is float:
            return float(value)
        if tp is str:
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"{origin}: `{name}` = {value!r} is not a valid {getattr(tp, '__name__', tp)}; fix the value."
        ) from None
    return value


def default_config_path() -> Path | None:
    p = Path("params.yaml")
    return p if p.is_file() else None


def load_params(path: str | os.PathLike | None) -> dict[str, Any]:
    if path is None:
        return {}
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass an existing params.yaml with --config.")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML ({e}); fix the syntax.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must be a mapping with sections like `precompute:` and `train:`.")
    return data


def build_config(cls: type, config_path: str | os.PathLike | None, overrides: dict[str, Any]):
    """Dataclass defaults, then params.yaml's section for `cls`, then `overrides` (flags given)."""
    section = SECTIONS[cls]
    params = load_params(config_path)
    yaml_section = params.get(section) or {}
    if not isinstance(yaml_section, dict):
        raise ConfigError(f"{config_path}: section `{section}` must be a mapping of option: value.")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, value in yaml_section.items():
        k = str(key).replace("-", "_")
        if k not in names:
            raise ConfigError(
                f"{config_path}: unknown option `{key}` in section `{section}`; "
                f"valid options are: {', '.join(sorted(names))}."
            )
        values[k] = _coerce(k, hints[k], value, f"{config_path} [{section}]")
    for key, value in overrides.items():
        if value is None:
            continue
        k = key.replace("-", "_")
        if k not in names:
            raise ConfigError(f"unknown option --{key.replace('_', '-')} for `{section}`.")
        values[k] = _coerce(k, hints[k], value, "command line")
    return cls(**values)


def to_dict(cfg) -> dict[str, Any]:
    """JSON-friendly view (tuples become lists) for manifests and run records."""
    d = dataclasses.asdict(cfg)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


__all__ = [
    "PrecomputeConfig",
    "TrainConfig",
    "EvalConfig",
    "ExportConfig",
    "build_config",
    "default_config_path",
    "to_dict",
    "field",
]
