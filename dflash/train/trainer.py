"""One training process: the `Trainer` (set-up, resume, the step loop, metrics, checkpoints).

`dflash.train.launch` starts one process per device (or torchrun does) and each calls `run_training` with
the run that preflight resolved once (dflash.train.resolved).
Every process reads its own part of every epoch (dflash.train.loader); the loss of an optimizer step is
normalised by the global sum of loss weights of that step, so W processes x A accumulation steps give the
gradient of one batch of W*A micro-batches, whatever W and A are (docs/DESIGN.md §3).

Exact resume (docs/DESIGN.md §7): `state_dict` holds model and optimizer state (and --ema-decay's average
of the weights, dflash.train.ema), the step, the data position (epoch, samples consumed, the plan's
balance group, the epoch's snapshot of the store) and the RNG states; the plan is a function of (seed,
epoch, balance group, snapshot) and anchors of (seed, epoch, sample id), so a resumed run sees the very
batches the uninterrupted run would have.  Each epoch has its own snapshot (dflash.train.epochs): a store
that grew is seen from the next epoch on, with new loader workers; an epoch over the same snapshot as the
last reuses the last one's (docs/DESIGN.md §7).
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dflash.config import TrainConfig
from dflash.cpu_threads import cpu_threads, deterministic_kernels
from dflash.errors import ConfigError
from dflash.hostgc import StepGC
from dflash.train import checkpoint as ckpt
from dflash.train import context_scale, ema
from dflash.train import loader as L
from dflash.train.batch_slots import BatchSlots, default_num_slots
from dflash.train.epochs import EpochSource
from dflash.train.feeder import DeviceFeeder
from dflash.train.loss import loss_kernel_note
from dflash.train.metrics import RunLogger, StepProfiler
from dflash.train.preflight import prepare_run_dir, resolved_by_rank0
from dflash.train.resolved import ResolvedRun
from dflash.train.step import HOST_PHASES, StepStats, TrainStep, compile_count, compiled, lr_at
from dflash.train.tracker import StepTracker

__all__ = ["Trainer", "run_training", "lr_at", "HOST_PHASES", "StepStats"]


class Trainer:
    """The drafter's training in this process: `train()` runs `train_step()` until the last step."""

    def __init__(self, run: ResolvedRun, device: torch.device, rank: int = 0, world: int = 1,
                 step_gc: StepGC | None = None):
        cfg = run.cfg
        self.run, self.cfg, self.device, self.rank, self.world = run, cfg, device, rank, world
        self.step_gc = step_gc or StepGC(0)
        if world > 1 and cfg.systems.parallel == "fsdp" and cfg.monitor.eval_every:
            raise ConfigError("--eval-every needs the whole drafter in one process; with --parallel fsdp evaluate "
                              "checkpoints with `dflash eval` instead.")
        if rank == 0:
            prepare_run_dir(cfg)
        self._barrier()
        embed, head = run.embed_and_head(device)
        n_shapes = len(run.spec.s_shapes) * len(run.spec.q_shapes)
        self.step_fn = TrainStep(run.drafter_config, cfg, device, world, embed, head, n_shapes,
                                 final_norm=run.final_norm(device))
        self.eval_store = None  # rank 0's held-out store, opened at the first evaluation
        self.step, self.epoch, self.samples_done = 0, 0, 0
        self.snapshot: dict[str, int] | None = None  # the epoch's view of the store (None: take one)
        # Micro-batches balanced per optimizer step (plan._balanced_order): the plan groups this many.
        self.balance_group = world * cfg.optim.grad_accum if cfg.data.balance_steps else 1
        self.feeder, self.slots, self.wait_before = None, None, 0.0
        self.loader = self.sampler = self.loader_snapshot = None  # the DataLoader an epoch may reuse, and its snapshot
        self.writer = ckpt.CheckpointWriter()  # rank 0's checkpoint writes, off the training thread
        self.ema: ema.WeightEMA | None = None  # --ema-decay: set by a resume, else at the start of train()

    # ------------------------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """Everything a resumed run needs; collective under FSDP2 (every rank calls it)."""
        model_state, optim_state = self.step_fn.state_dict()
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        data = {"epoch": self.epoch, "samples_consumed": self.samples_done, "balance_group": self.balance_group,
                "epoch_snapshot": self.snapshot}
        state = {"model": model_state, "optimizer": optim_state, "step": self.step, "world_size": self.world,
                 "data": data, "rng": rng}
        if self.ema is not None:  # model.safetensors holds the average, train_state.pt the trained weights
            state["trained_model"], state["model"] = model_state, self.ema.state_dict(self.step_fn.raw)
        return state

    def load_state_dict(self, state: dict) -> None:
        self.step_fn.load_state_dict(ema.trained_weights(state), state["optimizer"])
        self.ema = ema.resumed(self.step_fn.raw, self.cfg.optim.ema_decay, state, say=self.rank == 0)
        self.step = int(state["step"])
        data = state["data"]
        self.epoch, self.samples_done = int(data["epoch"]), int(data["samples_consumed"])
        # The data position is a place in the checkpoint's plan, so its grouping stays, on any number of
        # processes (a checkpoint without one: a random order).
        self.balance_group = int(data.get("balance_group", 1))
        self.snapshot = data.get("epoch_snapshot")  # a checkpoint without one: the store as it is
        torch.set_rng_state(state["rng"]["cpu"])
        if self.device.type == "cuda" and "cuda" in state["rng"]:
            torch.cuda.set_rng_state(state["rng"]["cuda"])

    def resume(self) -> None:
        """Load the newest checkpoint of the run directory, if --resume and there is one; the run's record
        (a new ResolvedRun) says how the drafter's weights were set."""
        found = ckpt.load_latest(Path(self.cfg.job.out)) if self.cfg.checkpoint.resume else None  # skips unreadable ones
        init = self.run.drafter_init
        if found is None:
            if self.cfg.drafter.context_scale == "rms":
                self._set_context_scale()
            if init:
                from dflash.train import drafter_init

                self.step_fn.load_weights(drafter_init.load(init["copies"]))
                self.run = self.run.with_init_applied("fresh run: the listed tensors were copied from the target")
            return
        self.run = self.run.with_init_applied(f"resumed from {found[0].name}: the checkpoint's weights, nothing copied")
        latest, (model_state, drafter_cfg, train_state, _) = found
        changed = ckpt.arch_change(latest, drafter_cfg, self.run.drafter_config.to_hf_dict())
        if changed:
            raise ConfigError(changed)
        changed = context_scale.change(latest, model_state, self.cfg.drafter.context_scale)
        if changed:
            raise ConfigError(changed)
        if drafter_cfg != self.run.drafter_config.to_hf_dict():
            raise ConfigError(
                f"checkpoint {latest} was trained with a different drafter (block size, layers, layer types, "
                "sliding window, target layers or mask token); resume with the original options or start a "
                "new --out directory."
            )
        self.load_state_dict({"model": model_state, **train_state})

    def _set_context_scale(self) -> None:
        """A fresh --context-scale rms run: the factors preflight measured (measured here, the same way on
        every rank, if preflight expected a checkpoint that is gone)."""
        from dflash.drafter.dflash.model import CONTEXT_SCALE

        found = self.run.context_scale
        if found is None:
            from dflash.store import open_store

            found = context_scale.compute(open_store(self.cfg.job.store))
            self.run = dataclasses.replace(self.run, context_scale=found)
        self.step_fn.load_weights({CONTEXT_SCALE: found["scale"]})

    def save(self) -> None:
        """One checkpoint: all ranks gather the state into host memory, rank 0 hands it to the writer thread
        (the disk write overlaps the next steps: a checkpoint with its optimizer state is several times the
        drafter's weights), and everyone goes on once the state is gathered."""
        state = self.state_dict()
        if self.rank == 0:
            state = ckpt.host_snapshot(state, self.device)
            model_state = state.pop("model")
            self.writer.save(Path(self.cfg.job.out), self.step, model_state, self.run.drafter_config.to_hf_dict(),
                             state, self.run.record(self.world), keep=self.cfg.checkpoint.keep_checkpoints)
        self._barrier()

    # ------------------------------------------------------------------------------------ the loop

    def _open_epoch(self) -> None:
        """This epoch's dataset (its snapshot of the store), from the current data position; an epoch the
        position has finished is skipped for the next one."""
        source = EpochSource(self.cfg, dataclasses.replace(self.run.spec, balance_group=self.balance_group),
                             self.world, self.device, self.rank)
        while True:
            self.dataset, self.snapshot, waited = source.open(self.epoch, self.snapshot)
            self.wait_before += waited
            plan = self.dataset.plan(self.epoch)
            self.start_batch = plan.batch_at_samples(self.samples_done)
            self.epoch_steps_left = (len(plan) - self.start_batch) // source.per_step
            if self.epoch_steps_left:
                return
            self.epoch, self.samples_done, self.snapshot = self.epoch + 1, 0, None

    def _start_loader(self, total: int) -> None:
        """Sampler and feeder over the rest of this epoch, up to the last step, on the last epoch's loader
        (its workers, and their dataset) where this epoch's snapshot of the store is the same, else on a
        new one: restarting the workers would cost their start-up every epoch."""
        cfg = self.cfg
        steps = min(self.epoch_steps_left, total - self.step)
        if self.loader is not None and self.loader_snapshot == self.snapshot:
            self.dataset = self.sampler.ds  # the same samples; its plans are cached
            self.sampler.restart(self.epoch, self.start_batch, steps)
        else:
            self._stop_workers()
            self.sampler = L.RankSampler(self.dataset, self.rank, self.world, cfg.optim.grad_accum, self.epoch,
                                         self.start_batch, steps)
            if self.slots is None and cfg.data.batch_slots:
                # Context features travel in reusable shared slots, page-locked on a GPU (dflash.train.batch_slots).
                self.slots = BatchSlots(default_num_slots(cfg.data.num_workers, cfg.optim.grad_accum),
                                        L.batch_bytes(self.run.spec, self.run.feature_width),
                                        pin=self.device.type == "cuda")
            self.loader = L.make_loader(self.dataset, self.sampler, cfg.data.num_workers,
                                        pin_memory=self.device.type == "cuda", slots=self.slots, persistent=True)
            self.loader_snapshot = dict(self.snapshot)
        self.step_plan = self.sampler.step_keys()
        self.feeder = DeviceFeeder(self.loader, self.device, cfg.optim.grad_accum, slots=self.slots)

    def _close_loader(self, stop_workers: bool = True) -> None:
        """The feeder's end (its slots released); the loader's workers too, unless the next epoch may reuse them."""
        if self.feeder is not None:
            self.wait_before += self.feeder.wait_s
            self.feeder.close(stop_workers=stop_workers)
            self.feeder = None
            if self.slots is not None:
                self.slots.reset()  # the next iteration numbers its micro-batches from 0 again
        if stop_workers:
            self.loader = self.sampler = self.loader_snapshot = None

    def _stop_workers(self) -> None:
        if self.loader is not None:
            it = self.loader._iterator  # the persistent workers' iterator, kept by the DataLoader
            if it is not None:
                it._shutdown_workers()
            self.loader = self.sampler = self.loader_snapshot = None

    def stop_loader(self) -> None:
        """A failed run's loader workers stopped and joined now, before the error is reported: left to the
        interpreter's exit, a worker still sending a micro-batch (or its own error) to this process prints
        a traceback of its broken pipe after the run's one-paragraph message."""
        try:
            self._close_loader()
            self._stop_workers()
        except Exception:  # the error under way is what the user must see
            pass

    def data_wait_s(self) -> float:
        """Seconds this run's steps waited for data: the loaders, and --follow's waits for the store."""
        return self.wait_before + (self.feeder.wait_s if self.feeder is not None else 0.0)

    def epoch_samples(self) -> int:
        return int(self.dataset.plan(self.epoch).samples_before[-1])

    def train_step(self, total: int) -> int:
        """One optimizer step; returns the epoch its micro-batches came from.  Advances the data position,
        into the next epoch (a new snapshot, loader and workers) when this one is done."""
        cfg = self.cfg
        if not self.epoch_steps_left:
            self._close_loader(stop_workers=False)  # kept until the next epoch's snapshot says
            self.epoch, self.samples_done, self.snapshot = self.epoch + 1, 0, None
            self._open_epoch()
            self._start_loader(total)
        step_epoch, step_first, _ = next(self.step_plan)
        items = self.feeder.take()
        lr = lr_at(self.step, cfg, total)
        last_of_loader = self.epoch_steps_left == 1 or self.step + 1 >= total
        self.stats, self.new_shape = self.step_fn(items, self.feeder, lr, prefetch=not last_of_loader)
        if self.ema is not None:  # once per optimizer step, after all of its accumulated micro-batches
            self.ema.update(self.step_fn.raw)
        self.lr = lr
        self.step += 1
        self.epoch_steps_left -= 1
        # Data position: everything up to the end of this step's micro-batches, in samples.
        end = step_first + self.world * cfg.optim.grad_accum
        self.epoch, self.samples_done = step_epoch, int(self.dataset.plan(step_epoch).samples_before[end])
        return step_epoch

    def train(self) -> dict | None:
        """Resume if asked, then step to the end; rank 0 returns the final metrics."""
        cfg, step_gc = self.cfg, self.step_gc
        self.resume()
        if cfg.optim.ema_decay and self.ema is None:  # from the weights the first step starts at
            self.ema = ema.WeightEMA(self.step_fn.raw, cfg.optim.ema_decay)
        opened = time.perf_counter()  # the first step's interval counts the wait for data (--follow: the store)
        self._open_epoch()
        # With --epochs the run's length comes from the store as it is when the run starts (or resumes).
        total = cfg.optim.steps if cfg.optim.steps else max(1, int(cfg.optim.epochs * L.steps_per_epoch(self.dataset, self.world,
                                                                                           cfg.optim.grad_accum)))
        self._start_loader(total)
        logger = (RunLogger(cfg, self.run, self.dataset.store, self.rank, self.world, self.step, total,
                            loss_kernel=loss_kernel_note(cfg.objective.loss_kernel, cfg.objective.kd_weight > 0, self.device))
                  if self.rank == 0 else None)
        self.tracker = StepTracker(cfg, self.device, logger, total, host=self.step_fn.host, data_wait_s=self.data_wait_s,
                                   gc_s=lambda: step_gc.timer.total_s, since=opened)
        profiler = StepProfiler(cfg.job.out, self.rank, cfg.monitor.profile_start, cfg.monitor.profile_steps, self.device)
        steps_run = 0
        while self.step < total:
            profiler.before_step(steps_run)
            self.tracker.begin()
            compiles_before = compile_count()
            epoch = self.train_step(total)
            warm = steps_run < self._warm_steps()
            steps_run += 1
            step_gc.after_step(steps_run, warming_up=warm or self.new_shape)
            profiler.after_step(steps_run)
            self.tracker.end(self.stats, self.step, epoch, self.epoch_samples(), self.lr,
                             counts_recompiles=not (warm or self.new_shape), compiles_before=compiles_before)
            evaluate = cfg.monitor.eval_every and (self.step % cfg.monitor.eval_every == 0 or self.step == total)
            save = (cfg.checkpoint.save_every and self.step % cfg.checkpoint.save_every == 0) or self.step == total
            if evaluate or save:
                self.tracker.flush(self._heldout_eval() if evaluate else None)
            if save:
                self.save()
                step_gc.full()
            if evaluate or save:
                self.tracker.restart_clock()
        profiler.close()
        self.writer.wait()  # the last checkpoint is on disk before the run reports its end
        self.tracker.flush()
        final = logger.finish(self.tracker.tokens_per_s()) if logger else None
        self._close_loader()
        if self.slots is not None:
            self.slots.close()
        return final

    def _warm_steps(self) -> int:
        # A compiled DDP wrapper also compiles in its second step: DDP rebuilds its gradient buckets
        # after the first iteration (in gradient-ready order), which changes dynamo's graph split.
        ddp_compiled = self.step_fn.ddp is not None and compiled(self.cfg, self.device) and self.cfg.systems.ddp_overlap
        return 2 if ddp_compiled else 1

    def _heldout_eval(self) -> dict:
        """Offline tau on the held-out store, on rank 0 (the others wait for it at the next all-reduce)."""
        if self.rank != 0:
            return {}
        with ema.applied(self.ema, self.step_fn.raw):  # the drafter that is checkpointed and exported
            return self._evaluate()

    def _evaluate(self) -> dict:
        from dflash.store import open_store
        from dflash.train.heldout import offline_tau

        if self.eval_store is None:  # its manifest was checked by preflight
            self.eval_store = open_store(self.cfg.monitor.eval_store, require_complete=True)
        spec, fn = self.run.spec, self.step_fn
        t0 = time.perf_counter()  # each part ends in a host copy of its result, so the clock sees the GPU's time
        # A compiled drafter compiles every padded shape an eval meets, each a long pause in a short run:
        # one shape each, at the budgets, costs the evals a little padding instead (DESIGN §3).
        shapes = 1 if fn.compiled else spec.num_shapes
        res = offline_tau(fn.raw, fn.embed, fn.head, self.eval_store, num_anchors=self.cfg.data.num_anchors,
                          seed=self.cfg.job.seed, token_budget=spec.token_budget, block_budget=spec.block_budget,
                          num_shapes=shapes, progress=False)
        out = {"eval_tau": res["tau"], "eval_acc": res.get("accuracy"), "eval_s": time.perf_counter() - t0}
        if self.cfg.monitor.eval_walk_tokens:
            from dflash.train.walk import walk_tau

            t0 = time.perf_counter()
            walk = walk_tau(fn.raw, fn.embed, fn.head, self.eval_store, max_new_tokens=self.cfg.monitor.eval_walk_tokens,
                            token_budget=spec.token_budget, rows_per_batch=spec.rows_per_batch, num_shapes=shapes,
                            progress=False)
            out.update(eval_walk_tau=walk["tau"], eval_walk_s=time.perf_counter() - t0)
        return out

    def _barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def run_training(run: ResolvedRun | TrainConfig, device: str = "cpu") -> dict | None:
    """Train in this process (rank `RANK` of `WORLD_SIZE`, or alone); returns the final metrics.  `run`: as
    the launcher resolved it, or under torchrun the TrainConfig, which rank 0 resolves for every rank."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, **({"device_id": dev} if backend == "nccl" else {}))
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if dev.type == "cpu":
        torch.set_num_threads(cpu_threads(world))
    restore_kernels = deterministic_kernels(on=dev.type == "cpu")
    try:
        if isinstance(run, TrainConfig):
            run = resolved_by_rank0(run, rank, world)
        with StepGC(run.cfg.systems.gc_every) as step_gc:
            trainer = Trainer(run, dev, rank, world, step_gc)
            try:
                return trainer.train()
            except BaseException:
                trainer.stop_loader()
                raise
    finally:
        restore_kernels()
        if dist.is_initialized():
            dist.destroy_process_group()
