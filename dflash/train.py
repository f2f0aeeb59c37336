"""One training process: distributed set-up, the drafter (DDP or FSDP2), the step loop, metrics, resume.

`dflash.launch` starts one of these per device (or torchrun does).  Every process reads its own part of
every epoch (dflash.loader); the loss of an optimizer step is normalised by the global sum of loss
weights of that step (one all-reduce of a scalar before the backward passes), so W processes x A
accumulation steps give the gradient of one batch of W*A micro-batches, whatever W and A are.

Exact resume: model and optimizer state, the step, the data position (epoch, samples consumed, the
plan's balance group) and the RNG states go into every checkpoint; the data plan is a function of (seed,
epoch, balance group), anchors of (seed, epoch, sample id), so a resumed run sees the very batches the
uninterrupted run would have.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from dflash import checkpoint as ckpt
from dflash import loader as L
from dflash import masks
from dflash import parallel
from dflash.batch_slots import BatchSlots, default_num_slots
from dflash.config import TrainConfig
from dflash.errors import ConfigError
from dflash.feeder import DeviceFeeder
from dflash.hostgc import StepGC
from dflash.loss import block_loss, loss_kernel_note
from dflash.metrics import RunLogger, StepProfiler, step_record
from dflash.preflight import Setup, prepare_run_dir, preflight

__all__ = ["preflight", "run_training", "lr_at", "HOST_PHASES"]

HOST_PHASES = ("fwd", "loss", "bwd", "opt", "sync")


def lr_at(step: int, cfg: TrainConfig, total: int) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr at the last step (step is 0-based)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, total - cfg.warmup_steps)
    t = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def _init_distributed(device: str) -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        kw = {"device_id": torch.device(device)} if backend == "nccl" else {}
        dist.init_process_group(backend=backend, **kw)
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _build_model(setup: Setup, cfg: TrainConfig, device: torch.device, world: int):
    """(module to call, the raw drafter, the DDP wrapper or None) with DDP / FSDP2 and compile applied."""
    from dflash.model import DFlashDrafter

    torch.manual_seed(cfg.seed)  # same init on every rank (DDP would broadcast it anyway)
    raw = DFlashDrafter(setup.drafter_config).to(device)
    ddp = parallel.wrap(raw, cfg.parallel, device, world)
    if _compiled(cfg, device):
        # Compiled in place (state_dict keys unchanged), in this main thread, once; shapes come from a
        # short list (loader.shape_set) and each (S, Q) pair compiles once.
        n_shapes = len(setup.spec.s_shapes) * len(setup.spec.q_shapes)
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 2 * n_shapes + 4)
        # ddp_overlap: the DDP wrapper is compiled, not the drafter: dynamo then splits the graph at DDP's
        # gradient buckets and each bucket's all-reduce can overlap the rest of the backward.  Otherwise
        # the drafter is compiled whole (one graph each way, as on one GPU) and DDP gets every gradient at
        # once, after the backward: the all-reduce is exposed, but no NCCL kernel shares the SMs with the
        # backward or waits there for a slower rank.  docs/BENCHMARKS.md has the A/B.
        # Not mode="reduce-overhead" (CUDA graphs): with it the compiled backward re-recorded its graph in
        # every step, 23% (1 GPU) and 48% (2 GPUs) slower on an H200; the GPU is ~97% busy without it.
        (ddp if ddp is not None and cfg.ddp_overlap else raw).compile(dynamic=False)
    return (ddp or raw), raw, ddp


def _optimizer(raw, cfg: TrainConfig, device: torch.device):
    decay = [p for p in raw.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in raw.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # Fused (one kernel over all parameters, and it takes the clipping factor as grad_scale, see
    # _clip); on CPU too, so tests run the same path, except FSDP2 on CPU, which it does not support.
    fused = device.type == "cuda" or _plain_params(cfg)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), fused=fused)


def _plain_params(cfg: TrainConfig) -> bool:
    return cfg.parallel != "fsdp"


def _clip(raw, optimizer, cfg: TrainConfig, world: int) -> torch.Tensor:
    """The gradient norm; gradients above cfg.grad_clip are scaled down by the fused AdamW kernel itself
    (its grad_scale input divides every gradient as it reads it), which saves clip_grad_norm_'s extra
    read-modify-write pass over all gradients (~2 ms a step for a 1B-parameter drafter on H200)."""
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
    if not optimizer.defaults.get("fused") or (world > 1 and not _plain_params(cfg)):
        norm = torch.nn.utils.clip_grad_norm_(raw.parameters(), max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    norm = torch.nn.utils.get_total_norm([p.grad for p in raw.parameters() if p.grad is not None])
    # clip_grad_norm_'s factor max_norm / (norm + 1e-6) when below 1, as a divisor
    optimizer.grad_scale = ((norm + 1e-6) / max_norm).clamp_min(1.0)
    return norm


def _state_dicts(raw, optimizer):
    """Full (unsharded) model and optimizer state keyed by parameter names, the same for DDP, FSDP2 and a
    single process (so a checkpoint resumes under any of them); collective under FSDP2: all ranks call."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict)

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(raw, options=opts), get_optimizer_state_dict(raw, optimizer, options=opts)


def _load_state(raw, optimizer, model_state, optim_state):
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, set_model_state_dict, set_optimizer_state_dict)

    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(raw, model_state, options=opts)
    set_optimizer_state_dict(raw, optimizer, optim_state, options=opts)


def _compile_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["frames"]["total"])


def run_training(cfg: TrainConfig, device: str = "cpu") -> dict | None:
    """Train in this process (rank `RANK` of `WORLD_SIZE`, or alone); returns the final metrics."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    rank, world = _init_distributed(device)
    if dev.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        with StepGC(cfg.gc_every) as step_gc:
            return _train(cfg, dev, rank, world, step_gc)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def _train(cfg: TrainConfig, device: torch.device, rank: int, world: int, step_gc: StepGC) -> dict | None:
    setup = preflight(cfg)
    run = Path(cfg.out)
    fsdp = world > 1 and cfg.parallel == "fsdp"
    if fsdp and cfg.eval_every:
        raise ConfigError("--eval-every needs the whole drafter in one process; with --parallel fsdp evaluate "
                          "checkpoints with `dflash eval` instead.")
    resume_from = None
    if rank == 0:
        prepare_run_dir(cfg)
    _barrier(world)
    if cfg.resume:
        resume_from = ckpt.latest_checkpoint(run)

    model, raw, ddp = _build_model(setup, cfg, device, world)
    optimizer = _optimizer(raw, cfg, device)
    embed, head = setup.embed_and_head(device)
    step, epoch, samples_done = 0, 0, 0
    # Micro-batches balanced per optimizer step (plan._balanced_order): the plan groups this many.
    balance_group = world * cfg.grad_accum if cfg.balance_steps else 1
    if resume_from is not None:
        model_state, drafter_cfg, train_state, _ = ckpt.load_checkpoint(resume_from)
        if drafter_cfg != setup.drafter_config.to_hf_dict():
            raise ConfigError(
                f"checkpoint {resume_from} was trained with a different drafter (block size, layers, target "
                "layers or mask token); resume with the original options or start a new --out directory."
            )
        _load_state(raw, optimizer, model_state, train_state["optimizer"])
        step = int(train_state["step"])
        epoch, samples_done = int(train_state["data"]["epoch"]), int(train_state["data"]["samples_consumed"])
        # The data position is a place in the checkpoint's plan, so its grouping stays, on any number of
        # processes (checkpoints from before balancing have none: a random order).
        balance_group = int(train_state["data"].get("balance_group", 1))
        torch.set_rng_state(train_state["rng"]["cpu"])
        if device.type == "cuda" and "cuda" in train_state["rng"]:
            torch.cuda.set_rng_state(train_state["rng"]["cuda"])
        del model_state, train_state

    dataset = L.PackedDataset(setup.store, dataclasses.replace(setup.spec, balance_group=balance_group))
    total = cfg.steps if cfg.steps else max(1, int(cfg.epochs * L.steps_per_epoch(dataset, world, cfg.grad_accum)))
    start_batch = dataset.plan(epoch).batch_at_samples(samples_done)
    sampler = L.RankSampler(dataset, rank, world, cfg.grad_accum, epoch, start_batch, max(0, total - step))
    # Context features travel in reusable shared slots, page-locked on a GPU (dflash.batch_slots).
    slots = BatchSlots(default_num_slots(cfg.num_workers, cfg.grad_accum),
                       L.batch_bytes(setup.spec, setup.store.hidden_size * setup.store.num_layers),
                       pin=device.type == "cuda") if cfg.batch_slots else None
    loader = L.make_loader(dataset, sampler, cfg.num_workers, pin_memory=device.type == "cuda", slots=slots)
    step_plan = sampler.step_keys()

    autocast = (torch.autocast("cuda", dtype=torch.bfloat16)
                if device.type == "cuda" and cfg.precision in ("auto", "bf16") else nullcontext())
    logger = (RunLogger(cfg, setup, rank, world, step, total,
                        loss_kernel=loss_kernel_note(cfg.loss_kernel, cfg.kd_weight > 0, device)) if rank == 0 else None)
    # Compilations are expected the first time each (S, Q) shape pair appears (a short list, see
    # loader.shape_set); any other compilation is a recompile, and should stay at zero.
    compiles0, shapes_seen, recompiles = _compile_count(), set(), 0
    feeder = DeviceFeeder(loader, device, cfg.grad_accum, slots=slots)
    profiler = StepProfiler(cfg.out, rank, cfg.profile_start, cfg.profile_steps, device)
    gc_timer = step_gc.timer
    compiled = _compiled(cfg, device)
    t_last = time.perf_counter()
    tokens_total, time_total = 0, 0.0
    final = pending = last_event = None
    steps_run = 0
    # The host's time per step by phase (seconds, summed over micro-batches).  "sync" is the time blocked
    # on the device (finish): a large share means the host ran a step ahead (GPU-bound); near zero, it never
    # got ahead, either busy launching or blocked inside a launch by a full CUDA launch queue.
    host = dict.fromkeys(HOST_PHASES, 0.0)
    host_last = dict(host)  # at the end of the previous step's interval (t_last)

    def finish(p: dict, extra: dict | None = None) -> None:
        """Turn a step's device-side stats into its metrics record (the only host sync of a step: done
        one step late, so the GPU never waits for the host) and log it."""
        nonlocal tokens_total, time_total, last_event
        if p["event"] is not None:
            t = time.perf_counter()
            p["event"].synchronize()
            host["sync"] += time.perf_counter() - t
            # The step's duration on the device's timeline, end of the previous step to end of this one:
            # the host's loop runs ahead of the GPU by up to a step, so host intervals swing widely.
            if last_event is not None:
                p["device_dt"] = last_event.elapsed_time(p["event"]) / 1e3
            last_event = p["event"]
        rec = step_record(p, p["vals"].tolist(), cfg, device, _compile_count() - compiles0)
        rec.update(extra or {})
        if p["step"] > 1 or total == 1:
            tokens_total, time_total = tokens_total + rec["ctx_tokens"], time_total + p["dt"]
        if logger:
            logger.log(rec)

    while step < total:
        profiler.before_step(steps_run)
        wait0, gc0 = feeder.wait_s, gc_timer.total_s
        step_epoch, step_first, _ = next(step_plan)
        items = feeder.take()
        # The step's loss is the weighted mean over every label of every process's micro-batches; the
        # weight sums come from the workers (host floats), so no sync is needed to know them.
        denom = sum(b["loss_weight_sum"] for b, _ in items)
        if world > 1:
            denom = _on_device(torch.tensor(denom, dtype=torch.float64), device)
            dist.all_reduce(denom)
        lr = lr_at(step, cfg, total)
        for g in optimizer.param_groups:
            g["lr"] = lr
        stats = torch.zeros(8 + 2 * cfg.block_size, dtype=torch.float64, device=device)
        new_shapes, compiles_before = set(), _compile_count()
        for i, item in enumerate(items):
            m = feeder.ready(item)
            shape = tuple(m["labels"].shape) + (m["ctx_positions"].shape[1],)
            if shape not in shapes_seen:
                new_shapes.add(shape)
                shapes_seen.add(shape)
            last_micro = i == len(items) - 1
            # Gradients are exchanged once per optimizer step, after the last micro-batch.
            sync = ddp.no_sync() if ddp is not None and not last_micro else nullcontext()
            if fsdp:
                raw.set_requires_gradient_sync(last_micro)
            with sync:
                out = _forward_backward(model, m, embed, head, autocast, cfg, denom=denom / world, fused=compiled,
                                        clock=host)
            if i == 0 and step + 1 < total:
                # The next step's host-to-device copies overlap this step's compute.  None after the
                # last step: asking an exhausted DataLoader for more joins its workers (~0.3 s on an
                # H200 host), which would be counted as the last step's data wait.
                feeder.prefetch()
            counts = _on_device(torch.tensor([m["num_ctx_tokens"], m["num_block_tokens"], m["num_samples"]],
                                             dtype=torch.float64), device)
            stats += torch.cat([
                torch.stack([out.ce_sum.double(), out.kd_sum.double(), out.weight_sum.double(),
                             out.tau_sum.double(), out.num_blocks.double()]),
                counts, out.correct.double(), out.valid.double()])
        t_opt = time.perf_counter()
        grad_norm = _clip(raw, optimizer, cfg, world)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        host["opt"] += time.perf_counter() - t_opt
        if world > 1:
            dist.all_reduce(stats)
        step += 1
        # Data position: everything up to the end of this step's micro-batches, in samples.
        plan = dataset.plan(step_epoch)
        end = step_first + world * cfg.grad_accum
        epoch, samples_done = step_epoch, int(plan.samples_before[end])
        # A compiled DDP wrapper also compiles in its second step: DDP rebuilds its gradient buckets
        # after the first iteration (in gradient-ready order), which changes dynamo's graph split.
        warm = steps_run < (2 if ddp is not None and compiled and cfg.ddp_overlap else 1)
        if not new_shapes and not warm:
            recompiles += _compile_count() - compiles_before
        steps_run += 1
        step_gc.after_step(steps_run, warming_up=warm or bool(new_shapes))
        profiler.after_step(steps_run)
        now = time.perf_counter()
        dt, t_last = now - t_last, now
        phases, host_last = {k: host[k] - host_last[k] for k in HOST_PHASES}, dict(host)
        vals = torch.cat([stats, grad_norm.detach().double().reshape(1)])
        vals_host, event = vals, None
        if device.type == "cuda":
            vals_host = torch.empty(vals.shape, dtype=vals.dtype, pin_memory=True)
            vals_host.copy_(vals, non_blocking=True)
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        if pending is not None:
            finish(pending)  # its sync wait falls in the next step's host interval, and is counted there
        pending = dict(vals=vals_host, event=event, step=step, epoch=step_epoch, lr=lr, dt=dt,
                       data_wait=feeder.wait_s - wait0, gc=gc_timer.total_s - gc0, recompiles=recompiles,
                       host=phases)
        evaluate = cfg.eval_every and (step % cfg.eval_every == 0 or step == total)
        save = (cfg.save_every and step % cfg.save_every == 0) or step == total
        if evaluate or save:
            finish(pending, _offline_eval(setup, raw, embed, head, rank) if evaluate else None)
            pending = None
        if save:
            _save(run, setup, raw, optimizer, step,
                  {"epoch": epoch, "samples_consumed": samples_done, "balance_group": balance_group}, rank, world,
                  device)
            step_gc.full()
    profiler.close()
    if pending is not None:
        finish(pending)
    if logger:
        final = logger.finish(tokens_total / time_total if time_total else 0.0)
    del feeder, loader
    if slots is not None:
        slots.close()
    return final


def _on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor onto the training device without a host sync.  A plain .to(cuda) from pageable
    memory waits for the whole stream: once per step, the host then stops running ahead of the GPU and
    the GPU idles while the next step is launched (this cost the two-GPU step; see docs/BENCHMARKS.md)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _compiled(cfg: TrainConfig, device: torch.device) -> bool:
    return cfg.compile == "on" or (cfg.compile == "auto" and device.type == "cuda")


def _forward_backward(model, m: dict, embed, head, autocast, cfg: TrainConfig, denom, fused: bool = False,
                      clock: dict | None = None):
    """Drafter forward on one micro-batch, chunked lm_head loss, backward; returns the LossOutput.

    `denom` is the step's global weight sum divided by the number of processes, which DDP / FSDP then
    average over: the gradient of the global weighted mean.  `clock` accumulates the host's seconds in
    the forward, the loss and the backward (HOST_PHASES)."""
    t0 = time.perf_counter()
    if m["ctx_hidden"].is_cuda:
        block_mask = masks.to_block_mask(m["mask"])  # BlockMask.from_kv_blocks: metadata came from the workers
    else:
        # flex_attention has no CPU backward; the dense mask from the same descriptors is the CPU path
        # (the model would otherwise expand the BlockMask through mask_mod, ~10x slower).
        block_mask = masks.to_dense_mask(m["mask"])
    with autocast:
        block_embeds = torch.nn.functional.embedding(m["block_input_ids"], embed)
        hidden = model(m["ctx_hidden"], block_embeds, m["ctx_positions"], m["block_positions"], block_mask)
    t1 = time.perf_counter()
    out = block_loss(hidden, head, m["labels"], m["loss_weight"], block_size=cfg.block_size, denom=denom,
                     topk_ids=m.get("topk_ids"), topk_logprobs=m.get("topk_logprobs"), kd_weight=cfg.kd_weight,
                     kd_temperature=cfg.kd_temperature, chunk=cfg.lm_head_chunk,
                     label_index=m.get("label_index"), fused=fused, kernel=cfg.loss_kernel)
    t2 = time.perf_counter()
    out.loss.backward()
    if clock is not None:
        clock["fwd"] += t1 - t0
        clock["loss"] += t2 - t1
        clock["bwd"] += time.perf_counter() - t2
    return out


def _save(run: Path, setup: Setup, raw, optimizer, step: int, data: dict, rank: int, world: int,
          device: torch.device) -> None:
    """One checkpoint (all ranks gather state, rank 0 writes), then everyone waits for the write."""
    model_state, optim_state = _state_dicts(raw, optimizer)
    if rank == 0:
        rng = {"cpu": torch.get_rng_state()}
        if device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(device)
        train_state = {"optimizer": optim_state, "step": step, "world_size": world, "data": data, "rng": rng}
        ckpt.save_checkpoint(run, step, model_state, setup.drafter_config.to_hf_dict(), train_state,
                             setup.record(world), keep=setup.cfg.keep_checkpoints)
    _barrier(world)


def _offline_eval(setup: Setup, raw, embed, head, rank: int) -> dict:
    """Offline tau on the held-out store, on rank 0 (the others wait for it at the next all-reduce)."""
    if rank != 0:
        return {}
    from dflash.evaluate import offline_tau

    res = offline_tau(raw, embed, head, setup.eval_store, num_anchors=setup.cfg.num_anchors, seed=setup.cfg.seed,
                      token_budget=setup.spec.token_budget, block_budget=setup.spec.block_budget, progress=False)
    return {"eval_tau": res["tau"], "eval_acc": res.get("accuracy")}
