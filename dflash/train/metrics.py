"""Rank 0's training outputs: one record per step (metrics.jsonl, TensorBoard, the tqdm bar), and at the
end metrics.json and curves.csv (what `dvc metrics` / `dvc plots` read); and, in every process, an
optional profile of a few steps (StepProfiler)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from dflash.config import TrainConfig
from dflash.drafter import family
from dflash.jsonl import jsonl_lines
from dflash.train.batch_slots import default_num_slots
from dflash.train.loader import PREFETCH_FACTOR, batch_bytes, target_agreement
from dflash.train.preflight import truncate_metrics
from dflash.train.resolved import ResolvedRun


def agreement_note(store, labels: str) -> str:
    """The banner's word on the data against the target: how often they agree (a store with top-k), and with
    --labels data on data the target did not write (under 90%), what to train on instead."""
    found = target_agreement(store)
    if found is None:
        return ""
    share, n = found
    hint = (" (the data is not the target's own: --labels rollout trains on what the engine verifies, "
            "docs/DESIGN.md §3, docs/RECIPE.md)" if labels == "data" and share < 0.9 else "")
    return (f"; the data's supervised tokens equal the target's greedy token at {100 * share:.1f}% of {n:,} "
            f"positions (the first samples){hint}")


def peak_mem_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


def step_record(p, s, device_dt: float | None, cfg: TrainConfig, device: torch.device, compiles: int) -> dict:
    """A step's metrics record from its PendingStep `p` and StepStats `s` (dflash.train.tracker)."""
    wsum = max(s.weight_sum, 1e-12)
    fam = family(cfg.drafter.arch)  # the objective's mix of its terms (docs/DESIGN.md §3)
    dt = device_dt or p.dt  # rates: the device's timeline when known (GPU), else the host's
    return {
        "step": p.step,
        "epoch": p.epoch,
        "epoch_samples": p.epoch_samples,
        "loss": fam.loss_sum(s, cfg) / wsum,
        "ce": s.ce_sum / wsum,
        "kd": s.kd_sum / wsum,
        **fam.metrics(s, wsum),
        "acc": [c / v if v else None for c, v in zip(s.correct, s.valid)][1:],
        "tau": s.tau_sum / max(s.num_blocks, 1),
        "lr": p.lr,
        "grad_norm": s.grad_norm,
        "ctx_tokens": int(s.ctx_tokens),
        "ctx_tokens_per_s": s.ctx_tokens / dt,
        "block_tokens_per_s": s.block_tokens / dt,
        "samples": int(s.samples),
        "damaged_skipped": int(s.damaged),  # samples --skip-damaged left out of this step (all processes)
        "data_wait_frac": p.data_wait / p.dt,  # both measured on the host
        "gc_frac": p.gc / p.dt,  # Python garbage collection's share of the host's step
        # the host's step by phase (dflash.train.step.HOST_PHASES): launching fwd / loss / bwd / opt, and waiting for
        # the device (sync).  A large sync share: the host was a step ahead (GPU-bound); near zero: it never
        # got ahead (busy launching, or blocked in a launch by a full CUDA launch queue).
        **{f"host_{k}_frac": v / p.dt for k, v in p.host.items()},
        "peak_mem_gb": peak_mem_gb(device),
        "compiles": compiles,
        "recompiles": p.recompiles,
    }


class RunLogger:
    """Rank 0's outputs: metrics.jsonl, TensorBoard, the tqdm bar and the final metrics.json."""

    def __init__(self, cfg: TrainConfig, run: ResolvedRun, store, rank: int, world: int, start_step: int,
                 total: int, loss_kernel: str = "torch"):
        """`store`: the first epoch's view of the training store (dflash.store.Store)."""
        from torch.utils.tensorboard import SummaryWriter
        from tqdm import tqdm

        self.run = Path(cfg.job.out)
        self.records = truncate_metrics(self.run / "metrics.jsonl", start_step)
        self.file = open(self.run / "metrics.jsonl", "a")
        self.tb = SummaryWriter(str(self.run / "tb"), purge_step=start_step + 1 if start_step else None)
        self.bar = tqdm(total=total, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
        cut = int((store.lengths() > run.spec.s_shapes[-1]).sum())
        one = batch_bytes(run.spec, run.feature_width)
        n_slots = default_num_slots(cfg.data.num_workers, cfg.optim.grad_accum)  # dflash.train.batch_slots
        self.bar.write(
            f"dflash train: {len(store)} samples, {world} process(es), steps {start_step}->{total}, "
            f"mask token {run.mask_token_id} ({run.mask_token_source}), shapes S {run.spec.s_shapes} "
            f"Q {run.spec.q_shapes}, loss kernel {loss_kernel}, drafter layers "
            f"{','.join(t.split('_')[0] for t in run.drafter_config.layer_types)} ({run.layer_types_source})"
            + (f"; {cut} samples are longer than --token-budget and are cut to it" if cut else "")
            + agreement_note(store, cfg.data.labels)
            + (f"; host memory for batches: {n_slots * one / 1e9:.2f} GB of shared slots per process ({n_slots} slots "
               f"= {cfg.data.num_workers} workers + 3 x {cfg.optim.grad_accum} micro-batches per step + 1, x {one / 1e6:.1f} MB; "
               "page-locked on a GPU; fewer --num-workers or --rows-per-batch lower it)" if cfg.data.batch_slots else
               f"; host memory for batches in flight: up to {cfg.data.num_workers * PREFETCH_FACTOR * one / 1e9:.2f} GB per "
               f"process ({cfg.data.num_workers} workers x {PREFETCH_FACTOR} ready x {one / 1e6:.1f} MB)"),
            file=sys.stderr)
        (self.run / "config.json").write_text(json.dumps(run.record(world), indent=2, default=str))

    def log(self, rec: dict) -> None:
        self.records.append(rec)
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=f"train/{k}", simple_value=float(v)) for k, v in rec.items()
                  if isinstance(v, (int, float)) and k != "step"]
        values += [Summary.Value(tag=f"acc/pos{k:02d}", simple_value=float(a)) for k, a in enumerate(rec["acc"], start=1)
                   if a is not None]
        # Every scalar of the step in one event: an add_scalar each (~38 at block 16) costs the training
        # thread several times the host time of one event a step.
        self.tb.file_writer.add_summary(Summary(value=values), rec["step"])
        self.bar.set_postfix(loss=f"{rec['loss']:.3f}", tau=f"{rec['tau']:.2f}",
                             tok_s=f"{rec['ctx_tokens_per_s']:.0f}", refresh=False)
        self.bar.update(1)

    def finish(self, tokens_per_s: float) -> dict:
        self.bar.close()
        if self.records:
            r = self.records[-1]
            print(f"trained {r['step']} steps: loss {r['loss']:.4f}, tau {r['tau']:.3f}, {tokens_per_s:,.0f} "
                  f"context tokens/s, recompiles after warm-up {r.get('recompiles', 0)}; run in {self.run}",
                  file=sys.stderr)
        self.tb.close()
        self.file.close()
        last = self.records[-1] if self.records else {}
        tail = self.records[-10:]
        final = {
            "steps": last.get("step", 0),
            "loss": last.get("loss"),
            "tau": last.get("tau"),
            "loss_last10": sum(r["loss"] for r in tail) / max(1, len(tail)),
            "tau_last10": sum(r["tau"] for r in tail) / max(1, len(tail)),
            "acc": last.get("acc"),
            "tokens_per_s": tokens_per_s,
            "compiles": last.get("compiles"),
            "recompiles": last.get("recompiles"),
        }
        tmp = self.run / ".metrics.json.tmp"
        tmp.write_text(json.dumps(final, indent=2))
        os.replace(tmp, self.run / "metrics.json")
        self._write_curves()
        return final

    def _write_curves(self) -> None:
        """curves.csv (step, loss, tau, lr) from the whole metrics.jsonl, resumed segments included:
        `dvc plots` reads CSV, not JSONL."""
        rows = [json.loads(line) for line in jsonl_lines((self.run / "metrics.jsonl").read_text(encoding="utf-8")) if line.strip()]
        tmp = self.run / ".curves.csv.tmp"
        with open(tmp, "w") as f:
            f.write("step,loss,tau,lr\n")
            for r in rows:
                f.write(f"{r['step']},{r['loss']:.6f},{r['tau']:.6f},{r.get('lr', 0.0):.6g}\n")
        os.replace(tmp, self.run / "curves.csv")


class StepProfiler:
    """torch.profiler over `steps` optimizer steps, from the `start`-th step this process runs (after
    compilation and warm-up), in every process: where a step's time goes on this host, e.g. why two GPUs
    do not train twice as fast as one.  Writes <out>/profile/rank<r>.txt (operators and kernels by self
    device time, CPU time on a CPU run) and rank<r>.trace.json (Chrome trace: chrome://tracing, Perfetto)."""

    def __init__(self, out, rank: int, start: int, steps: int, device: torch.device):
        self.dir, self.rank, self.device = Path(out) / "profile", rank, device
        self.start, self.end = start, (start + steps if steps > 0 else None)
        self.prof = None

    def before_step(self, steps_run: int) -> None:
        if self.end is not None and self.prof is None and steps_run == self.start:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.prof = profile(activities=acts)
            self.prof.__enter__()

    def after_step(self, steps_run: int) -> None:
        if self.prof is not None and steps_run >= self.end:
            self.close()

    def close(self) -> None:
        """Stop (also when the run ends inside the window) and write the table and the trace."""
        if self.prof is None:
            return
        prof, self.prof, self.end = self.prof, None, None
        prof.__exit__(None, None, None)
        self.dir.mkdir(parents=True, exist_ok=True)
        key = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=60, max_name_column_width=90)
        (self.dir / f"rank{self.rank}.txt").write_text(table)
        prof.export_chrome_trace(str(self.dir / f"rank{self.rank}.trace.json"))
