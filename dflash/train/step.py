"""One optimizer step of the drafter: the model (DDP / FSDP2, compiled), the optimizer, and `TrainStep`,
which runs the forward, chunked lm_head loss and backward of a step's micro-batches and the clipped
optimizer update, leaving the step's statistics on the device (docs/DESIGN.md §3, §7).

The trainer (dflash.train.trainer) and the step benchmark (bench/train_step.py) run this same object.
"""

from __future__ import annotations

import dataclasses
import math
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from dflash.config import TrainConfig
from dflash.drafter import attention, family_of
from dflash.drafter.family import LossInputs
from dflash.drafter.labels import labelled
from dflash.train import objectives as obj
from dflash.train import parallel
from dflash.train.batch import MicroBatch
from dflash.train.loss import block_loss, chunk_kernel

HOST_PHASES = ("fwd", "loss", "bwd", "opt", "sync")


def lr_at(step: int, cfg: TrainConfig, total: int) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr at the last step (step is 0-based)."""
    if step < cfg.optim.warmup_steps:
        return cfg.optim.lr * (step + 1) / cfg.optim.warmup_steps
    span = max(1, total - cfg.optim.warmup_steps)
    t = min(1.0, (step - cfg.optim.warmup_steps) / span)
    return cfg.optim.lr * (cfg.optim.min_lr_ratio + (1 - cfg.optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def compiled(cfg: TrainConfig, device: torch.device) -> bool:
    return cfg.systems.compile == "on" or (cfg.systems.compile == "auto" and device.type == "cuda")


@dataclasses.dataclass
class StepStats:
    """A step's sums over its micro-batches (and, after the all-reduce, over processes), by name.

    On the device they travel as one flat float64 vector (`zeros`, `add`), so that a step costs one
    all-reduce and one device-to-host copy; `from_vector` names its entries again on the host."""

    ce_sum: float
    kd_sum: float
    weight_sum: float
    tau_sum: float
    num_blocks: float
    ctx_tokens: float
    block_tokens: float
    samples: float
    damaged: float  # samples --skip-damaged left out (their checksums failed)
    tv_sum: float  # a family's distance to the target (LossOutput.tv_sum); else 0
    conf_sum: float  # a family's confidence term (LossOutput.conf_sum); else 0
    correct: list[float]  # per block position 0..B-1: greedy predictions equal to the label
    valid: list[float]  # per block position: labels
    grad_norm: float

    SCALARS = ("ce_sum", "kd_sum", "weight_sum", "tau_sum", "num_blocks", "ctx_tokens", "block_tokens", "samples",
               "damaged", "tv_sum", "conf_sum")

    @classmethod
    def zeros(cls, block_size: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(len(cls.SCALARS) + 2 * block_size, dtype=torch.float64, device=device)

    @staticmethod
    def add(vec: torch.Tensor, out, counts: torch.Tensor) -> None:
        """Add one micro-batch's loss output and (ctx tokens, block tokens, samples, damaged) counts, in place."""
        zero = out.ce_sum.new_zeros((), dtype=torch.float64)
        own = [zero if t is None else t.double() for t in (out.tv_sum, out.conf_sum)]
        vec += torch.cat([
            torch.stack([out.ce_sum.double(), out.kd_sum.double(), out.weight_sum.double(),
                         out.tau_sum.double(), out.num_blocks.double()]),
            counts, torch.stack(own), out.correct.double(), out.valid.double()])

    @classmethod
    def from_vector(cls, v: list[float], block_size: int) -> StepStats:
        n, B = len(cls.SCALARS), block_size
        return cls(*v[:n], correct=v[n:n + B], valid=v[n + B:n + 2 * B], grad_norm=v[n + 2 * B])


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor onto the training device without a host sync.  A plain .to(cuda) from pageable
    memory waits for the whole stream: once per step, the host then stops running ahead of the GPU and
    the GPU idles while the next step is launched."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def compile_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["frames"]["total"])


def build_model(drafter_config, cfg: TrainConfig, device: torch.device, world: int, n_shapes: int,
                flex_kernel_options: dict | None = None):
    """(module to call, the raw drafter, the DDP wrapper or None) with DDP / FSDP2 and compile applied."""
    from dflash.drafter import build_drafter

    torch.manual_seed(cfg.job.seed)  # same init on every rank (DDP would broadcast it anyway)
    # --context-scale rms: the buffer starts at ones; the trainer sets it (a fresh run) or loads it (resume).
    raw = build_drafter(drafter_config, flex_kernel_options,
                        context_scale=cfg.drafter.context_scale == "rms").to(device)  # any family
    ddp = parallel.wrap(raw, cfg.systems.parallel, device, world)
    if compiled(cfg, device):
        # Compiled in place (state_dict keys unchanged), in this main thread, once; each (S, Q) shape pair
        # of the plan's short list compiles once.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 2 * n_shapes + 4)
        # ddp_overlap: the DDP wrapper is compiled, not the drafter: dynamo then splits the graph at DDP's
        # gradient buckets and each bucket's all-reduce can overlap the rest of the backward.  Otherwise
        # the drafter is compiled whole and DDP gets every gradient at once, after the backward: the
        # all-reduce is exposed, but no NCCL kernel shares the SMs with the backward.  Not CUDA graphs
        # (mode="reduce-overhead"): the compiled backward re-recorded its graph every step
        # (benchmarks/train-step-qwen3-8b-h200-2026-12-01.md).
        (ddp if ddp is not None and cfg.systems.ddp_overlap else raw).compile(dynamic=False)
    return (ddp or raw), raw, ddp


def make_optimizer(raw, cfg: TrainConfig, device: torch.device):
    decay = [p for p in raw.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in raw.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # Fused (one kernel over all parameters, taking the clipping factor as grad_scale, see clip); on CPU
    # too, so tests run the same path, except FSDP2 on CPU, which it does not support.
    fused = device.type == "cuda" or cfg.systems.parallel != "fsdp"
    return torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), fused=fused)


def clip(raw, optimizer, cfg: TrainConfig, world: int, params: list | None = None) -> torch.Tensor:
    """The gradient norm; gradients above cfg.optim.grad_clip are scaled down by the fused AdamW kernel itself
    (its grad_scale input divides every gradient as it reads it), which saves clip_grad_norm_'s extra
    read-modify-write pass over all gradients.  `params`: raw's parameters, listed once by the caller
    (walking the module tree is host time in every step)."""
    max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
    params = list(raw.parameters()) if params is None else params
    if not optimizer.defaults.get("fused") or (world > 1 and cfg.systems.parallel == "fsdp"):
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    # clip_grad_norm_'s factor max_norm / (norm + 1e-6) when below 1, as a divisor
    optimizer.grad_scale = ((norm + 1e-6) / max_norm).clamp_min(1.0)
    return norm


class TrainStep:
    """The drafter, its optimizer and the frozen target embedding / lm_head, and one optimizer step."""

    def __init__(self, drafter_config, cfg: TrainConfig, device: torch.device, world: int, embed, head,
                 n_shapes: int = 1, flex_kernel_options: dict | None = None, final_norm=None):
        self.cfg, self.device, self.world = cfg, device, world
        self.model, self.raw, self.ddp = build_model(drafter_config, cfg, device, world, n_shapes, flex_kernel_options)
        self.optimizer = make_optimizer(self.raw, cfg, device)
        self.params = list(self.raw.parameters())  # the same objects for the whole run (FSDP2 too, once wrapped)
        self.embed, self.head = embed, head
        self.family = family_of(drafter_config)
        self.final_norm = final_norm  # the target's final norm weight, for a family that needs it (StoreNeeds)
        self.compiled = compiled(cfg, device)
        _ = self.loss_kernel  # an unknown --loss-kernel fails here, at build, not at the first step
        self.fsdp = world > 1 and cfg.systems.parallel == "fsdp"
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16)
                         if device.type == "cuda" and cfg.systems.precision in ("auto", "bf16") else nullcontext())
        # The host's seconds per phase, summed over steps.  "sync" (waiting for the device) is added by
        # the trainer when it reads a step's statistics.
        self.host = dict.fromkeys(HOST_PHASES, 0.0)
        self.shapes_seen: set[tuple] = set()

    def __call__(self, items: list, feeder, lr: float, prefetch: bool = True) -> tuple[torch.Tensor, bool]:
        """One optimizer step over the micro-batches `items` (as `feeder.take()` gave them): returns the
        step's StepStats vector (on the device, all-reduced) and whether a new (S, Q) shape appeared.

        The step's loss is the weighted mean over every label of every process's micro-batches; the
        weight sums come from the workers as host floats, so no sync is needed to know them."""
        cfg, device = self.cfg, self.device
        denom = sum(b.loss_weight_sum for b, _ in items)
        if self.world > 1:
            denom = on_device(torch.tensor(denom, dtype=torch.float64), device)
            dist.all_reduce(denom)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        stats = StepStats.zeros(cfg.drafter.block_size, device)
        new_shape = False
        for i, item in enumerate(items):
            m = feeder.ready(item)
            shape = m.shape
            if shape not in self.shapes_seen:
                new_shape = True
                self.shapes_seen.add(shape)
            last_micro = i == len(items) - 1
            # Gradients are exchanged once per optimizer step, after the last micro-batch.
            sync = self.ddp.no_sync() if self.ddp is not None and not last_micro else nullcontext()
            if self.fsdp:
                self.raw.set_requires_gradient_sync(last_micro)
            with sync:
                # micro_batch: this micro-batch's own mean / the step's micro-batches (DDP averages processes)
                out = self.forward_backward(m, denom / self.world if cfg.objective.loss_norm == "step"
                                            else max(item[0].loss_weight_sum, 1e-12) * len(items))
            if i == 0 and prefetch:
                # The next step's host-to-device copies overlap this step's compute.
                feeder.prefetch()
            counts = on_device(torch.tensor([m.num_ctx_tokens, m.num_block_tokens, m.num_samples, m.num_damaged],
                                            dtype=torch.float64), device)
            StepStats.add(stats, out, counts)
        t_opt = time.perf_counter()
        grad_norm = clip(self.raw, self.optimizer, cfg, self.world, self.params)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.host["opt"] += time.perf_counter() - t_opt
        if self.world > 1:
            dist.all_reduce(stats)
        return torch.cat([stats, grad_norm.detach().double().reshape(1)]), new_shape

    def forward_backward(self, m: MicroBatch, denom):
        """Drafter forward on one micro-batch, chunked lm_head loss, backward; returns the LossOutput.

        `denom` is the step's global weight sum divided by the number of processes, which DDP / FSDP then
        average over: the gradient of the global weighted mean."""
        clock = self.host
        t0 = time.perf_counter()
        block_mask = attention.mask_for(m.mask, m.ctx_hidden.device, compiled=self.compiled)
        with self.autocast:
            block_embeds = torch.nn.functional.embedding(m.block_input_ids, self.embed)
            hidden = self.model(m.ctx_hidden, block_embeds, m.ctx_positions, m.block_positions, block_mask)
        t1 = time.perf_counter()
        out = self.loss(m, hidden, denom)
        t2 = time.perf_counter()
        out.loss.backward()
        clock["fwd"] += t1 - t0
        clock["loss"] += t2 - t1
        clock["bwd"] += time.perf_counter() - t2
        return out

    def loss(self, m: MicroBatch, hidden: torch.Tensor, denom):
        """The drafter family's loss (dflash.drafter.family): DFlash's is block_loss with the run's objective,
        the loader's decay weights or D-PACE's (--loss, dflash.train.objectives); a family adds its own terms."""
        cfg, labels, weight = self.cfg, m.labels, m.loss_weight
        B, alpha = cfg.drafter.block_size, cfg.objective.dpace_alpha

        def decayed(top_k: int):
            sel = labelled(labels, m.label_index)
            reweight = None
            if cfg.objective.loss == "dpace":
                def reweight(ce):
                    return obj.dpace_loss_weight(ce, labels, weight, sel, B, alpha).reshape(-1).index_select(0, sel)
            return block_loss(hidden, self.head, labels, weight, block_size=B, denom=denom, topk_ids=m.topk_ids,
                              topk_logprobs=m.topk_logprobs, kd_weight=cfg.objective.kd_weight,
                              kd_temperature=cfg.objective.kd_temperature, chunk=cfg.objective.lm_head_chunk,
                              label_index=sel, kernel=self.loss_kernel, reweight=reweight, top_k=top_k)

        return self.family.loss(LossInputs(
            drafter=self.raw, hidden=hidden, lm_head=self.head, labels=labels, loss_weight=weight,
            block_input_ids=m.block_input_ids, label_index=m.label_index, block_size=B, denom=denom,
            chunk=cfg.objective.lm_head_chunk, options=self.family.section(cfg), block_loss=decayed,
            topk_ids=m.topk_ids, topk_logprobs=m.topk_logprobs, final_hidden=m.final_hidden, final_norm=self.final_norm))

    @property
    def loss_kernel(self) -> str:
        """The per-chunk loss kernel (loss.KERNELS) of the config as it is now, read at every step: a caller
        that changes cfg.objective.loss_kernel or kd_weight after building the step (the step bench's
        variants do) gets the kernel it asked for, not the one the build saw."""
        o = self.cfg.objective
        return chunk_kernel(o.loss_kernel, o.kd_weight > 0, self.device, self.compiled)

    def state_dict(self) -> tuple[dict, dict]:
        """Full (unsharded) model and optimizer state keyed by parameter names, the same for DDP, FSDP2 and
        one process (so a checkpoint resumes under any of them); collective under FSDP2: all ranks call."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return (get_model_state_dict(self.raw, options=opts),
                get_optimizer_state_dict(self.raw, self.optimizer, options=opts))

    def load_weights(self, tensors: dict) -> None:
        """Overwrite these drafter parameters (full tensors by name), the others untouched; on every process,
        under DDP, FSDP2 or alone (--drafter-init target, before the first step)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.raw, tensors, options=StateDictOptions(full_state_dict=True, strict=False))

    def load_state_dict(self, model_state: dict, optim_state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.raw, model_state, options=opts)
        set_optimizer_state_dict(self.raw, self.optimizer, optim_state, options=opts)
