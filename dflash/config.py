"""Every knob of every stage, as dataclasses.

Values come from three layers, later ones winning: the dataclass default, the stage's section of
`params.yaml` (`--config`, default `./params.yaml` when present), then flags given on the command line.
Unknown keys in params.yaml are an error (a typo there would otherwise silently do nothing).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dflash.errors import ConfigError


def opt(default: Any = None, help: str = "", choices: tuple[str, ...] | None = None) -> Any:
    """A config field with its help text, written once: `dflash <command> --help`, docs/OPTIONS.md and
    params.yaml's documentation all read it from here."""
    meta = {"help": help, "choices": choices}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


AUTO_ON_OFF = ("auto", "on", "off")


@dataclass
class PrecomputeConfig:
    """`dflash precompute`: run the target over a dataset and write a store (docs/DESIGN.md §5)."""

    target: str = opt("", "Local directory of the target checkpoint (any AutoModelForCausalLM).")
    data: str = opt("", "Conversations: json/jsonl/parquet/arrow file(s) or a saved `datasets` directory.")
    out: str = opt("", "Store directory to write; rerunning the same command resumes it.")
    shards: int = opt(1, "Shards = processes, one per GPU; under torchrun the world size wins.")
    gpus: str = opt("auto", "'auto' (CUDA when present), 'cpu', or GPU ids '0,1,2,3,4' (one per shard).")
    target_layers: list[int] | None = opt(
        None, "0-based target layers to capture, e.g. 1,9,17,25,33 (the output of layer i); "
        "default: evenly spaced for --num-draft-layers, never the last layer (docs/DESIGN.md §2).")
    num_draft_layers: int = opt(3, "Drafter depth the default target layers are chosen for (as `dflash train "
                                "--num-layers`, default 3).")
    max_length: int = opt(2048, "Samples longer than this many tokens are truncated (and counted).")
    topk: int = opt(8, "Target top-k log-probs stored per position, for KD; 0 = off.")
    hidden_dtype: str = opt("bf16", "Stored hidden states: bf16, or fp8 (e4m3 with a per-token-per-layer scale: "
                            "half the bytes).", ("bf16", "fp8"))
    final_hidden: bool = opt(False, "Store the target's last hidden state too (`final_hidden` [T, H], the last "
                             "decoder layer's output before the final norm, in --hidden-dtype): DSpark "
                             "needs it. Adds 2*H bytes per token in bf16, H+4 in fp8.")
    token_budget: int = opt(16384, "Tokens per target forward batch (padded length x rows).")
    lm_head_chunk: int = opt(4096, "Positions per lm_head chunk when computing the top-k.")
    commit_every_tokens: int = opt(32768, "A shard commits (becomes durable and resumable) every N tokens.")
    store_chunk_tokens: int | None = opt(None, "Zarr inner chunk in tokens; default ~4 MB of hidden states.")
    split: str = opt("train", "Split to read from a saved DatasetDict.")
    max_samples: int | None = opt(None, "Read only the first N rows (smoke tests).")
    render_workers: int | None = opt(None, "Processes per shard that render rows (chat template + tokenizer) ahead "
                                     "of the capture; 0 renders inline. Default: on a GPU, the host's cores per "
                                     "shard less 2, at most 8; on the CPU, 0.")
    dtype: str = opt("auto", "Target compute dtype: auto = bf16 on GPU, fp32 on CPU.", ("auto", "bf16", "fp32"))
    compile: str = opt("auto", "torch.compile the top-k log-prob reduction (auto: on for CUDA).", AUTO_ON_OFF)
    writer: str = opt("process", "Where the store is written: a process per shard (keeps the GIL free for the "
                      "GPU) or a thread of the shard's process.", ("process", "thread"))
    trust_remote_code: bool = opt(False, "Allow the target's own modelling code (only when you trust it).")
    overwrite: bool = opt(False, "Delete an existing store and start over.")
    append: bool = opt(False, "Grow an existing store: capture only the conversations of --data it does not hold "
                       "(matched by content, not row), as a new part; committed samples stay as they are.")
    skip_bad_rows: bool = opt(False, "Leave out the rows dflash cannot use (unknown format or role, a content that "
                              "is not text, a conversation the chat template refuses or renders without its "
                              "replies) instead of stopping; each is listed in STORE/skipped_rows.jsonl with its "
                              "file, line and reason, and counted in the summary.")
    restart_changed: bool = opt(False, "Start over, instead of refusing, when the existing store was made from "
                                "other inputs (for pipelines); a store of the same inputs is resumed, and with "
                                "--append another dataset is not another input.")
    seed: int = opt(0, "Seed of the shard split.")


@dataclass
class TrainConfig:
    """`dflash train`: train a drafter from a store, one process per device (docs/DESIGN.md §3, §7)."""

    store: str = opt("", "Store written by `dflash precompute`.")
    target: str = opt("", "The target checkpoint: its embedding and lm_head are read from it, frozen.")
    out: str = opt("", "Run directory: metrics, TensorBoard events, checkpoints.")
    gpus: str = opt("cpu:1", "'5,6,7' = one process per GPU; 'cpu:N' = N CPU processes (gloo).")
    # drafter shape
    block_size: int = opt(16, "Tokens per drafted block.")
    num_layers: int = opt(3, "Drafter layers.  3: the best measured tau per GPU-second and per FLOP at block 16 "
                          "(docs/RECIPE.md, setup c); 5 is the published z-lab layout.")
    mask_token_id: int | None = opt(None, "Token id of the masked block positions; default a spare id of the "
                                    "target's embedding table.")
    target_layers: list[int] | None = opt(None, "Target layers the drafter reads; default (and required) the "
                                          "store's.")
    layer_types: list[str] | None = opt(None, "Attention of each drafter layer, full or sliding, e.g. "
                                        "sliding,sliding,full (as vLLM / SGLang serve them: a sliding layer is "
                                        "causal with --sliding-window); default all full, except on a Qwen3.5/3.6 target: "
                                        "sliding layers then one full, window 2048, as its published drafters.")
    sliding_window: int | None = opt(None, "Window of the sliding layers in tokens, the query's own included "
                                     "(a query at p sees keys p-W < j <= p).")
    drafter_init: str = opt("random", "Initial weights of the drafter's layers: random = N(0, 0.02) linears and "
                            "unit norms (as z-lab's DFlash); target = copies of the target's last --num-layers "
                            "layers (attention, q/k norms, MLP, layer norms; fc and the drafter's own norms stay "
                            "random), on a fresh run only (docs/DESIGN.md §2).", ("random", "target"))
    # schedule
    steps: int | None = opt(None, "Total optimizer steps; default derived from --epochs.")
    epochs: float = opt(1.0, "Epochs over the store (when --steps is not given).")
    lr: float = opt(6e-4, "Peak learning rate (AdamW).")
    min_lr_ratio: float = opt(0.1, "The cosine schedule ends at lr x this.")
    warmup_steps: int = opt(20, "Linear warm-up steps.")
    weight_decay: float = opt(0.0, "AdamW weight decay (matrices only).")
    betas: tuple[float, float] = opt((0.9, 0.95), "AdamW betas, e.g. 0.9,0.95.")
    grad_clip: float = opt(1.0, "Clip the global gradient norm to this; 0 = off.")
    grad_accum: int = opt(1, "Micro-batches per process per optimizer step.")
    # data
    token_budget: int = opt(4096, "Context tokens per packed row (longer samples are cut to it).")
    block_budget: int | None = opt(None, "Block (query) tokens per packed row; default = --token-budget.  It also "
                                   "caps the blocks of one sample at block_budget / block_size.")
    num_shapes: int = opt(3, "Padded row shapes per stream: multiples of 128 at budget, /2, /4, ...")
    rows_per_batch: int = opt(1, "Packed rows per micro-batch per process (4 on an H200 at the 8B shape, "
                              "docs/BENCHMARKS.md).")
    num_anchors: int = opt(64, "Anchors (blocks) drawn per sample per epoch, at most.")
    num_workers: int = opt(2, "DataLoader worker processes per training process (masks are built there).")
    skip_damaged: bool = opt(False, "Skip a sample whose stored bytes fail their checksums (each one named on "
                             "stderr, counted as damaged_skipped in metrics.jsonl) instead of stopping the run.")
    balance_steps: bool = opt(True, "Give the processes of a step micro-batches of similar cost (else a random "
                              "order).")
    batch_slots: bool = opt(True, "Workers hand over context features in reusable shared, page-locked slots, "
                            "instead of a fresh shared tensor per micro-batch.")
    seed: int = opt(0, "Seed of anchors, data order and initialisation.")
    # loss
    gamma: float | None = opt(None, "Position weight decay exp(-(k-1)/gamma); default 7 for B=16, 5 for B=10, "
                              "4 for B=8, else B/2-1.")
    labels: str = opt("data", "What a block position is trained to predict: data = the dataset's next token; "
                      "target = the target's own greedy next token (the store's top-1), what the engine accepts, "
                      "for data the target did not write (docs/DESIGN.md §3). Needs a store with --topk.",
                      ("data", "target"))
    kd_weight: float = opt(0.0, "Weight of the KD term against the stored top-k.")
    kd_temperature: float = opt(1.0, "Temperature of the KD term.")
    loss_norm: str = opt("step", "Loss normalisation: step = the weighted mean over every label of the optimizer "
                         "step (all micro-batches and processes, the gradient of one big batch); micro_batch = "
                         "each micro-batch's own weighted mean, averaged (as per-micro-batch trainers do; "
                         "docs/RECIPE.md).", ("step", "micro_batch"))
    lm_head_chunk: int = opt(2048, "Block positions per lm_head + loss chunk.")
    loss_kernel: str = opt("triton", "The lm_head chunks' softmax and gradient: dflash's Triton kernel (CUDA, KD "
                           "off; elsewhere it falls back) or torch.compile'd.", ("triton", "compiled"))
    # DFlash2 and D-PACE (docs/DESIGN.md §11)
    arch: str = opt("dflash", "Drafter: dflash; dflash2 (grouped dynamic block convolutions and a top-K candidate "
                    "selector; exported as DFlash2DraftModel); dspark (a Markov head and a confidence head; exported "
                    "as Qwen3DSparkModel, docs/DESIGN.md §12).", ("dflash", "dflash2", "dspark"))
    loss: str = opt("ce", "Per-position weights of the cross-entropy: ce = the exp(-(k-1)/gamma) decay; dpace = "
                    "D-PACE's, from the drafter's own per-token CE (arXiv 2605.18810).", ("ce", "dpace"))
    dpace_alpha: float = opt(0.5, "--loss dpace: smoothing of each position's probability, (1-alpha) p + alpha.")
    conv_kernel_size: int = opt(2, "--arch dflash2: taps of each block convolution.")
    conv_group_size: int = opt(16, "--arch dflash2: channels per dynamic coefficient (divides the hidden size).")
    selector_rank: int = opt(256, "--arch dflash2: rank of the candidate selector's transition.")
    selector_top_k: int = opt(16, "--arch dflash2: lm_head candidates the selector reranks per position.")
    selector_loss_weight: float = opt(1.0, "--arch dflash2: weight of the selector's K-way cross-entropy term.")
    # DSpark (docs/DESIGN.md §12)
    markov_rank: int = opt(256, "--arch dspark: rank of the Markov head's previous-token logit bias.")
    enable_confidence_head: bool = opt(True, "--arch dspark: train the confidence head (P(accept) per position).")
    confidence_head_with_markov: bool = opt(True, "--arch dspark: the confidence head also reads the Markov "
                                            "embedding of the previous token.")
    dspark_ce_weight: float = opt(0.1, "--arch dspark: weight of the cross-entropy term (DeepSpec's 0.1).")
    dspark_tv_weight: float = opt(0.9, "--arch dspark: weight of the distance to the target's distribution, "
                                  "sum |q - p| = 2 TV, as DeepSpec computes it (0.9).")
    dspark_confidence_weight: float = opt(1.0, "--arch dspark: weight of the confidence head's BCE against "
                                          "1 - TV, the acceptance probability.")
    tv_source: str = opt("final_hidden", "--arch dspark: the target distribution p: final_hidden = the full "
                         "distribution recomputed from the store's final hidden state (precompute --final-hidden); "
                         "topk = the stored top-k, renormalised.", ("final_hidden", "topk"))
    # systems
    parallel: str = opt("ddp", "Data parallelism.", ("ddp", "fsdp"))
    ddp_overlap: bool = opt(True, "DDP: all-reduce gradients during the backward (else after it).")
    compile: str = opt("auto", "torch.compile the drafter (auto: on for CUDA).", AUTO_ON_OFF)
    precision: str = opt("auto", "auto = bf16 autocast on CUDA, fp32 on CPU.", ("auto", "bf16", "fp32"))
    # bookkeeping
    save_every: int = opt(0, "Checkpoint every N steps (and always at the end); 0 = only at the end.")
    keep_checkpoints: int = opt(2, "Checkpoints kept in the run directory (the newest).")
    eval_every: int = opt(0, "Held-out tau on --eval-store every N steps (metrics.jsonl `eval_tau`, TensorBoard); "
                          "0 = off.")
    eval_store: str | None = opt(None, "Held-out store for --eval-every.")
    gc_every: int = opt(50, "Collect Python garbage every N steps, in step on every process; 0 = Python's own.")
    profile_steps: int = opt(0, "torch.profiler over this many steps per process: <out>/profile/; 0 = off.")
    profile_start: int = opt(5, "Steps of this run before profiling starts (after compilation and warm-up).")
    resume: bool = opt(False, "Continue from the newest checkpoint in --out.")
    overwrite: bool = opt(False, "Delete an existing run directory first.")
    follow: bool = opt(False, "Train while precompute writes the store: wait for it to exist and hold a step's "
                       "samples; each epoch plans over the samples committed when it starts.  Needs --steps.")
    follow_poll: float = opt(10.0, "--follow: seconds between looks at the store while waiting for samples.")
    follow_timeout: float = opt(0.0, "--follow: give up after waiting this many seconds for the store; 0 = wait "
                                "as long as it takes.")


@dataclass
class EvalConfig:
    """`dflash eval`: offline tau on a held-out store, or online speculative decoding (docs/DESIGN.md §6)."""

    run: str = opt("", "Run directory or checkpoint directory.")
    store: str | None = opt(None, "Held-out store: offline acceptance length.")
    prompts: str | None = opt(None, "Held-out conversations: online speculative decoding against the target.")
    target: str | None = opt(None, "Target directory (online; offline only when the run does not record it).")
    out: str | None = opt(None, "Output JSON; default RUN/eval.json.")
    plots: bool = opt(True, "Write PNG plots beside the JSON.")
    max_samples: int | None = opt(None, "Evaluate at most N samples or prompts.")
    max_new_tokens: int = opt(128, "Tokens to generate per prompt (online).")
    reference: str | None = opt(None, "Online: a JSON file of the target-only greedy outputs, reused when it was "
                                "made from the same target, prompt tokens, --max-new-tokens, dtype and device "
                                "kind (written when absent or stale): evaluating many checkpoints then decodes "
                                "the target alone once.")
    num_anchors: int = opt(64, "Anchors per held-out sample (offline).")
    device: str = opt("auto", "'auto', 'cpu' or 'cuda:0'.")
    dtype: str = opt("fp32", "Online target and drafter dtype: fp32 keeps the lossless check exact; bf16 is "
                     "serving speed.", ("fp32", "bf16"))
    seed: int = opt(0, "Seed of the held-out anchors.")
    confidence_threshold: float = opt(0.5, "Online, --arch dspark: also decode with the confidence head choosing "
                                      "the drafts to verify (survival probability >= this, as vLLM's "
                                      "dspark_confidence_threshold); tau both ways in the JSON; 0 = off.")


@dataclass
class ExportConfig:
    """`dflash export SOURCE OUT`: a DFlashDraftModel directory the serving engines load (docs/DESIGN.md §6)."""

    source: str = opt("", "Run directory or checkpoint directory.")
    out: str = opt("", "Export directory.")
    check: bool = opt(False, "Reload the export and compare its logits with the training model.")
    dtype: str = opt("bf16", "Weights dtype of the export; --check rounds the reference alike.",
                     ("bf16", "fp16", "fp32"))


@dataclass
class GenerateConfig:
    """`dflash generate`: the target writes the dataset's assistant turns, in-process or through an
    OpenAI-compatible server; resumable (docs/DESIGN.md §10)."""

    target: str = opt("", "Local target checkpoint: the in-process model; with --endpoint optional (its chat "
                      "template is checked for the thinking switch).")
    data: str = opt("", "Conversations: json/jsonl/parquet/arrow file(s) or a saved `datasets` directory.")
    out: str = opt("", "Output JSON-lines file, the rows in the format read; rerunning the same command resumes.")
    endpoint: str | None = opt(None, "Base URL of an OpenAI-compatible server (vLLM, SGLang, `transformers "
                               "serve`), e.g. http://127.0.0.1:8000/v1; default: generate in-process.")
    model: str | None = opt(None, "Model name on the server; default the one it lists, when it lists one.")
    gpus: str = opt("auto", "In-process: 'auto' (CUDA when present), 'cpu', or GPU ids '0,1' (one process each; an "
                    "id may repeat, '0,0,0,0' = four processes on GPU 0, for a small target whose generate "
                    "loop leaves the GPU idle).")
    dtype: str = opt("auto", "In-process dtype: auto = bf16 on GPU, fp32 on CPU.", ("auto", "bf16", "fp32"))
    batch_size: int = opt(32, "In-process: rows per generate batch (prompts of similar length batched together).")
    max_new_tokens: int = opt(2048, "Tokens per response at most; longer ones are cut and counted.")
    temperature: float = opt(0.0, "0 = greedy (reproducible, resumes to the same file); > 0 samples.")
    top_p: float = opt(1.0, "Nucleus sampling when --temperature > 0.")
    seed: int = opt(0, "Sampling seed (row r of a request is seeded seed + r on servers that take a seed).")
    thinking: str = opt("template", "The chat template's thinking switch (enable_thinking): on, off, or the "
                        "template's own default. Match the serving setup.", ("on", "off", "template"))
    turns: str = opt("all", "Assistant turns to regenerate: all (each after the target's own earlier turns), last, "
                     "or none (the rows written back as read: the pipeline's stage switched off).",
                     ("all", "last", "none"))
    concurrency: int = opt(16, "With --endpoint: requests in flight.")
    timeout: float = opt(600.0, "With --endpoint: seconds a request may take before it is retried.")
    retries: int = opt(5, "With --endpoint: retries of a request that timed out or met a connection error, 408, "
                       "429 or 5xx, with exponential backoff.")
    split: str = opt("train", "Split to read from a saved DatasetDict.")
    max_samples: int | None = opt(None, "Read only the first N rows.")
    trust_remote_code: bool = opt(False, "Allow the target's own modelling code (only when you trust it).")
    overwrite: bool = opt(False, "Discard an existing output and its journal and start over.")
    restart_changed: bool = opt(False, "Start over, instead of refusing, when the existing output was made from "
                                "other inputs (for pipelines); the same inputs resume.")


SECTIONS: dict[type, str] = {
    GenerateConfig: "generate",
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


# Options that run code from elsewhere: taken from the command line or a config file named with --config,
# never from a ./params.yaml picked up implicitly (a checkout's file should not turn them on unseen).
EXPLICIT_ONLY = ("trust_remote_code",)


def build_config(cls: type, config_path: str | os.PathLike | None, overrides: dict[str, Any],
                 explicit: bool = True):
    """Dataclass defaults, then params.yaml's section for `cls`, then `overrides` (flags given).

    `explicit`: the config file was named (--config), not found as ./params.yaml; an implicit one may not
    turn on an EXPLICIT_ONLY option.  trust_remote_code, when on, is announced on stderr."""
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
        values[k] = _check_choice(cls, k, _coerce(k, hints[k], value, f"{config_path} [{section}]"),
                                  f"{config_path} [{section}]")
        if k in EXPLICIT_ONLY and values[k] and not explicit and overrides.get(k) is None:
            flag = "--" + k.replace("_", "-")
            raise ConfigError(
                f"{config_path}: `{key}: true` in section `{section}` was read from a params.yaml found in the "
                f"current directory, not named with --config; {k} runs the target's own Python code, so it is "
                f"taken only from the command line ({flag}) or from a file passed with --config {config_path}. "
                "Pass one of those, or remove the key."
            )
    for key, value in overrides.items():
        if value is None:
            continue
        k = key.replace("-", "_")
        if k not in names:
            raise ConfigError(f"unknown option --{key.replace('_', '-')} for `{section}`.")
        values[k] = _check_choice(cls, k, _coerce(k, hints[k], value, "command line"), "command line")
    if values.get("trust_remote_code"):
        origin = "the command line" if overrides.get("trust_remote_code") else str(config_path)
        print(f"dflash: trust_remote_code is on (from {origin}): the target's own Python code will be run.",
              file=sys.stderr, flush=True)
    return cls(**values)


def _check_choice(cls: type, name: str, value: Any, origin: str) -> Any:
    choices = FIELDS[cls][name].metadata.get("choices")
    if choices and value is not None and value not in choices:
        raise ConfigError(f"{origin}: `{name}` = {value!r} is not one of {', '.join(choices)}; pick one of them.")
    return value


def show_default(f: dataclasses.Field) -> str:
    d = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    if d is None or d == "":
        return "-"
    if isinstance(d, (list, tuple)):
        return ",".join(map(str, d))
    return str(d).lower() if isinstance(d, bool) else str(d)


def options_markdown() -> str:
    """docs/OPTIONS.md: every option of every command, from the fields' help (tests check it is current)."""
    lines = ["# Options", "", "Generated from dflash/config.py by `python -m dflash.config > docs/OPTIONS.md`; "
             "a test checks it is current.", "", "Each command reads its section of `params.yaml` (`--config`, "
             "default `./params.yaml` when present); a flag given on the command line wins.", ""]
    for cls, section in SECTIONS.items():
        lines += [f"## `{section}`", "", (cls.__doc__ or "").strip(), "", "| option | default | meaning |",
                  "| --- | --- | --- |"]
        for f in dataclasses.fields(cls):
            choices = f.metadata.get("choices")
            text = f.metadata.get("help", "") + (f" One of: {', '.join(choices)}." if choices else "")
            lines.append(f"| `{f.name}` (`--{f.name.replace('_', '-')}`) | `{show_default(f)}` | {text} |")
        lines.append("")
    return "\n".join(lines)


def to_dict(cfg) -> dict[str, Any]:
    """JSON-friendly view (tuples become lists) for manifests and run records."""
    d = dataclasses.asdict(cfg)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


FIELDS: dict[type, dict[str, dataclasses.Field]] = {
    cls: {f.name: f for f in dataclasses.fields(cls)} for cls in SECTIONS
}

__all__ = [
    "GenerateConfig",
    "PrecomputeConfig",
    "TrainConfig",
    "EvalConfig",
    "ExportConfig",
    "build_config",
    "default_config_path",
    "to_dict",
    "field",
]


if __name__ == "__main__":
    print(options_markdown())
