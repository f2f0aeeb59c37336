"""`dflash train`'s options, in sections: one dataclass per concern, each field's help written once.

params.yaml may spell them nested (`train: {optim: {lr: 6e-4}}`) or flat (`train: {lr: 6e-4}`, the layout
before sections); the command line stays flat (`--lr`).  A field's name is unique across the sections, so
a flat name always says which section it belongs to (`TrainConfig.owner`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from dflash.drafter.registry import ARCHS, FAMILIES
from dflash.fields import AutoDtype, AutoOnOff, Options, check_rules, opt

Arch = Literal[ARCHS]  # the drafter families (dflash.drafter.registry)
DrafterInit = Literal["random", "target"]
Labels = Literal["data", "target", "rollout"]
LossNorm = Literal["step", "micro_batch"]
LossKernel = Literal["triton", "compiled"]
Loss = Literal["ce", "dpace"]
Parallel = Literal["ddp", "fsdp"]
ContextScale = Literal["none", "rms"]


@dataclass
class Job(Options):
    """Where the run reads and writes, and on which devices."""

    store: str = opt("", "Store written by `dflash precompute`.")
    target: str = opt("", "The target checkpoint: its embedding and lm_head are read from it, frozen.")
    out: str = opt("", "Run directory: metrics, TensorBoard events, checkpoints.")
    gpus: str = opt("auto", "'5,6,7' = one process per GPU; 'cpu:N' = N CPU processes (gloo), each with the "
                    "cores / N intra-op threads, or OMP_NUM_THREADS when set; 'auto' = one process per visible "
                    "GPU, or cpu:1 without CUDA.")
    seed: int = opt(0, "Seed of anchors, data order and initialisation.")

    def rules(self) -> list[tuple[bool, str]]:
        return [(bool(getattr(self, name)), f"`dflash train` needs --{name} (or `{name}:` in the train section of "
                 "params.yaml).") for name in ("store", "target", "out")]


@dataclass
class Drafter(Options):
    """The drafter's shape and its initial weights (docs/DESIGN.md §2)."""

    arch: Arch = opt("dflash", "Drafter: " + "; ".join(f.name + (f" ({f.summary})" if f.summary else "")
                                                       for f in FAMILIES.values()) + ".")
    block_size: int = opt(16, "Tokens per drafted block.")
    num_layers: int = opt(3, "Drafter layers.  3: the best measured tau per GPU-second and per FLOP at block 16 "
                          "(benchmarks/made-targets-recipe-h200-2026-12-01.md, setup c); 5 is the published z-lab layout.")
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
    drafter_init: DrafterInit = opt("random", "Initial weights of the drafter's layers: random = N(0, 0.02) linears and "
                                    "unit norms (as z-lab's DFlash); target = copies of the target's last --num-layers "
                                    "layers (attention, q/k norms, MLP, layer norms; fc and the drafter's own norms stay "
                                    "random), on a fresh run only (docs/DESIGN.md §2).")
    context_scale: ContextScale = opt("none", "Preconditioning of fc's input channels (the concatenated target "
                                      "layers): none = as z-lab's DFlash; rms = each channel divided by its RMS "
                                      "over the store's first ~64K tokens (a power of two, fixed at the start of a "
                                      "fresh run, kept in the checkpoints), so that a few massive-activation "
                                      "channels do not dominate fc's updates.  Export folds it into fc.weight: "
                                      "the exported drafter is a plain DFlash drafter (docs/DESIGN.md §2).")

    def rules(self) -> list[tuple[bool, str]]:
        return [(self.block_size >= 2, "--block-size must be at least 2."),
                (self.num_layers >= 1, "--num-layers must be at least 1.")]


@dataclass
class Optim(Options):
    """The optimizer and its schedule: AdamW, linear warm-up, cosine decay."""

    steps: int | None = opt(None, "Total optimizer steps; default derived from --epochs.")
    epochs: float = opt(1.0, "Epochs over the store (when --steps is not given).")
    lr: float = opt(6e-4, "Peak learning rate (AdamW).")
    min_lr_ratio: float = opt(0.1, "The cosine schedule ends at lr x this.")
    warmup_steps: int = opt(20, "Linear warm-up steps.")
    weight_decay: float = opt(0.0, "AdamW weight decay (matrices only).")
    ema_decay: float = opt(0.0, "Exponential moving average of the drafter's weights; 0 = off.  With d > 0 the "
                           "drafter evaluated during training (--eval-every), written to the checkpoints' "
                           "model.safetensors (what `dflash eval` and `dflash export` read) and exported is the "
                           "average e <- d*e + (1-d)*w of the trained weights w after every optimizer step, "
                           "starting at the initial weights; e.g. 0.999 (an average over ~1000 steps).  Training "
                           "itself continues on w (kept in train_state.pt for --resume).")
    betas: tuple[float, float] = opt((0.9, 0.95), "AdamW betas, e.g. 0.9,0.95.")
    grad_clip: float = opt(1.0, "Clip the global gradient norm to this; 0 = off.")
    grad_accum: int = opt(1, "Micro-batches per process per optimizer step.")

    def rules(self) -> list[tuple[bool, str]]:
        return [(self.grad_accum >= 1, "--grad-accum must be at least 1."),
                (self.steps is None or self.steps >= 1, "--steps must be at least 1."),
                (self.steps is not None or self.epochs > 0, "--epochs must be positive."),
                (self.warmup_steps >= 0 and 0 <= self.min_lr_ratio <= 1, "warmup_steps >= 0 and 0 <= min_lr_ratio <= 1."),
                (0 <= self.ema_decay < 1, f"--ema-decay {self.ema_decay} is outside [0, 1): it is the weight the "
                 "moving average of the drafter's weights keeps at each optimizer step (e.g. 0.999), and 0 turns "
                 "the average off; at 1 it would never move from the initial weights.")]


@dataclass
class Data(Options):
    """What a micro-batch holds and how the loader builds it (docs/DESIGN.md §3, §4)."""

    token_budget: int = opt(4096, "Context tokens per packed row (longer samples are cut to it).")
    block_budget: int | None = opt(None, "Block (query) tokens per packed row; default = --token-budget.  It also "
                                   "caps the blocks of one sample at block_budget / block_size.")
    num_shapes: int = opt(3, "Padded row shapes per stream: multiples of 128 at budget, /2, /4, ...")
    rows_per_batch: int = opt(1, "Packed rows per micro-batch per process (4 on an H200 at the 8B shape, "
                              "benchmarks/train-step-qwen3-8b-h200-2026-12-01.md).")
    num_anchors: int = opt(64, "Anchors (blocks) drawn per sample per epoch, at most.")
    num_workers: int = opt(2, "DataLoader worker processes per training process (masks are built there).")
    skip_damaged: bool = opt(False, "Skip a sample whose stored bytes fail their checksums (each one named on "
                             "stderr, counted as damaged_skipped in metrics.jsonl) instead of stopping the run.")
    balance_steps: bool = opt(True, "Give the processes of a step micro-batches of similar cost (else a random "
                              "order).")
    batch_slots: bool = opt(True, "Workers hand over context features in reusable shared, page-locked slots, "
                            "instead of a fresh shared tensor per micro-batch.")
    labels: Labels = opt("data", "What a block position is trained to predict: data = the dataset's next token; "
                         "target = the target's own greedy next token (the store's top-1), what the engine accepts, "
                         "for data the target did not write; rollout = target, on the block positions the target's "
                         "own greedy walk from the anchor reaches (the data agrees with its greedy tokens before "
                         "them), the rest unsupervised (docs/DESIGN.md §3). target and rollout need a store with --topk.")

    def rules(self) -> list[tuple[bool, str]]:
        return [(self.num_workers >= 1, "--num-workers must be at least 1 (mask metadata is built in worker processes)."),
                (self.rows_per_batch >= 1, "rows_per_batch must be at least 1."),
                (self.num_anchors >= 1, "--num-anchors must be at least 1."),
                (self.token_budget >= 1, "--token-budget must be positive.")]


@dataclass
class Objective(Options):
    """The loss: position weights, knowledge distillation, and how the lm_head chunks compute it."""

    gamma: float | None = opt(None, "Position weight decay exp(-(k-1)/gamma); default 7 for B=16, 5 for B=10, "
                              "4 for B=8, else B/2-1.")
    loss: Loss = opt("ce", "Per-position weights of the cross-entropy: ce = the exp(-(k-1)/gamma) decay; dpace = "
                     "D-PACE's, from the drafter's own per-token CE (arXiv 2605.18810).")
    dpace_alpha: float = opt(0.5, "--loss dpace: smoothing of each position's probability, (1-alpha) p + alpha.")
    kd_weight: float = opt(0.0, "Weight of the KD term against the stored top-k.")
    kd_temperature: float = opt(1.0, "Temperature of the KD term.")
    loss_norm: LossNorm = opt("step", "Loss normalisation: step = the weighted mean over every label of the optimizer "
                              "step (all micro-batches and processes, the gradient of one big batch); micro_batch = "
                              "each micro-batch's own weighted mean, averaged (as per-micro-batch trainers do; "
                              "docs/RECIPE.md).")
    lm_head_chunk: int = opt(2048, "Block positions per lm_head + loss chunk.")
    loss_kernel: LossKernel = opt("triton", "The lm_head chunks' softmax and gradient: dflash's Triton kernel (CUDA, KD "
                                  "off; elsewhere it falls back) or torch.compile'd.")

    def rules(self) -> list[tuple[bool, str]]:
        return [(self.kd_weight >= 0, "--kd-weight must be >= 0.")]


@dataclass
class Systems(Options):
    """Parallelism, compilation, precision and the garbage collector."""

    parallel: Parallel = opt("ddp", "Data parallelism.")
    ddp_overlap: bool = opt(True, "DDP: all-reduce gradients during the backward (else after it).")
    compile: AutoOnOff = opt("auto", "torch.compile the drafter (auto: on for CUDA).")
    precision: AutoDtype = opt("auto", "auto = bf16 autocast on CUDA, fp32 on CPU.")
    gc_every: int = opt(50, "Collect Python garbage every N steps, in step on every process; 0 = Python's own.")


@dataclass
class Checkpoint(Options):
    """Checkpoints, resume and overwrite (docs/DESIGN.md §7)."""

    save_every: int = opt(0, "Checkpoint every N steps (and always at the end); 0 = only at the end.")
    keep_checkpoints: int = opt(2, "Checkpoints kept in the run directory (the newest).")
    resume: bool = opt(False, "Continue from the newest checkpoint in --out.")
    overwrite: bool = opt(False, "Delete an existing run directory first.")

    def rules(self) -> list[tuple[bool, str]]:
        return [(not (self.resume and self.overwrite), "--resume and --overwrite contradict each other; pick one.")]


@dataclass
class Monitor(Options):
    """Held-out tau during training, and the profiler."""

    eval_every: int = opt(0, "Held-out tau on --eval-store every N steps (metrics.jsonl `eval_tau`, TensorBoard); "
                          "0 = off.")
    eval_store: str | None = opt(None, "Held-out store for --eval-every.")
    eval_walk_tokens: int = opt(0, "With --eval-every, on a held-out store of the target's own greedy replies: also "
                                "the engine's walk over each reply's first N tokens (metrics `eval_walk_tau`: online "
                                "tau without the target in the loop); 0 = off.")
    profile_steps: int = opt(0, "torch.profiler over this many steps per process: <out>/profile/; 0 = off.")
    profile_start: int = opt(5, "Steps of this run before profiling starts (after compilation and warm-up).")

    def rules(self) -> list[tuple[bool, str]]:
        return [(self.profile_steps >= 0 and self.profile_start >= 0, "--profile-steps and --profile-start must be >= 0.")]


@dataclass
class Stream(Options):
    """`--follow`: train while precompute still writes the store."""

    follow: bool = opt(False, "Train while precompute writes the store: wait for it to exist and hold a step's "
                       "samples; each epoch plans over the samples committed when it starts.  Needs --steps.")
    follow_poll: float = opt(10.0, "--follow: seconds between looks at the store while waiting for samples.")
    follow_timeout: float = opt(0.0, "--follow: give up after waiting this many seconds for the store; 0 = wait "
                                "as long as it takes.")

    def rules(self) -> list[tuple[bool, str]]:
        return [(self.follow_poll > 0 and self.follow_timeout >= 0, "--follow-poll must be positive, --follow-timeout >= 0.")]


# each drafter family with options of its own has a section named after it (dflash.drafter.family)
FAMILY_SECTIONS: dict[str, type] = {f.name: f.options() for f in FAMILIES.values() if f.options() is not None}
SECTION_TYPES: dict[str, type] = {
    "job": Job, "drafter": Drafter, **FAMILY_SECTIONS, "optim": Optim, "data": Data,
    "objective": Objective, "systems": Systems, "checkpoint": Checkpoint, "monitor": Monitor, "stream": Stream,
}
# flat option name -> its section
OWNER: dict[str, str] = {f.name: s for s, cls in SECTION_TYPES.items() for f in dataclasses.fields(cls)}
assert len(OWNER) == sum(len(dataclasses.fields(c)) for c in SECTION_TYPES.values()), "a name in two sections"
assert not set(OWNER) & set(SECTION_TYPES), "a section named like an option"


def _with_family_sections(cls: type) -> type:
    """`cls` with a field for each family's section too, every field in SECTION_TYPES' order (so that
    dataclasses.replace and the field list carry the families' options like any other section)."""
    own = dict(cls.__annotations__)
    assert set(own) | set(FAMILY_SECTIONS) == set(SECTION_TYPES), "TrainConfig's fields are SECTION_TYPES"
    cls.__annotations__ = {name: own.get(name, section) for name, section in SECTION_TYPES.items()}
    for name, section in FAMILY_SECTIONS.items():
        setattr(cls, name, field(default_factory=section))
    return cls


@dataclass(init=False)
@_with_family_sections
class TrainConfig:
    """`dflash train`: train a drafter from a store, one process per device (docs/DESIGN.md §3, §7)."""

    job: Job = field(default_factory=Job)
    drafter: Drafter = field(default_factory=Drafter)
    # then the section of each drafter family with options of its own, named after it (FAMILY_SECTIONS)
    optim: Optim = field(default_factory=Optim)
    data: Data = field(default_factory=Data)
    objective: Objective = field(default_factory=Objective)
    systems: Systems = field(default_factory=Systems)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    monitor: Monitor = field(default_factory=Monitor)
    stream: Stream = field(default_factory=Stream)

    def __init__(self, **given: Any) -> None:
        """Sections (`optim=Optim(...)` or a dict of its fields) and flat options (`lr=1e-3`), the flat ones
        applied over their sections: `TrainConfig(block_size=8)` and `dataclasses.replace(cfg, lr=...)` work."""
        flat: dict[str, dict[str, Any]] = {}
        for name, value in given.items():
            if name not in SECTION_TYPES:
                if name not in OWNER:
                    raise TypeError(f"TrainConfig got an unexpected option {name!r}")
                flat.setdefault(OWNER[name], {})[name] = value
        for section, cls in SECTION_TYPES.items():
            value = given.get(section)
            if value is None:
                value = cls()
            elif isinstance(value, dict):
                value = cls(**value)
            elif not isinstance(value, cls):
                raise TypeError(f"TrainConfig.{section} must be a {cls.__name__}, not {type(value).__name__}")
            object.__setattr__(self, section, dataclasses.replace(value, **flat.get(section, {})))

    # Read-only flat view (`cfg.lr` is `cfg.optim.lr`), for scripts and tests written before the sections;
    # dflash's own code reads the sections.
    def __getattr__(self, name: str) -> Any:
        section = OWNER.get(name)
        if section is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(object.__getattribute__(self, section), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in OWNER:
            raise AttributeError(f"set cfg.{OWNER[name]}.{name}, not cfg.{name} (the option lives in its section)")
        object.__setattr__(self, name, value)

    @staticmethod
    def owner(name: str) -> str | None:
        """The section an option belongs to, or None for a name that is no option."""
        return OWNER.get(name)

    def sections(self) -> dict[str, Options]:
        return {s: getattr(self, s) for s in SECTION_TYPES}

    def rules(self) -> list[tuple[bool, str]]:
        """Every rule of every section, then those across sections."""
        d, o = self.drafter, self.optim
        return [r for s in self.sections().values() for r in s.rules()] + [
            (self.data.block_budget is None or self.data.block_budget >= d.block_size,
             "block_budget must hold at least one block."),
            (not self.stream.follow or o.steps is not None, "--follow needs --steps: the learning-rate schedule "
             "needs the run's length, and a store being written has no epoch length yet."),
        ]

    def check(self) -> None:
        """A ConfigError naming the first rule this config breaks (preflight calls it before anything runs)."""
        check_rules(self.rules())


__all__ = ["FAMILY_SECTIONS", "OWNER", "SECTION_TYPES", "Checkpoint", "Data", "Drafter", "Job", "Monitor", "Objective",
           "Optim", "Stream", "Systems", "TrainConfig"]
