"""One real training step of a Qwen3-8B-shaped DFlash drafter (5 layers unless --layers) on one GPU, against the baseline
that builds its BlockMask with `create_block_mask` every step.

    python bench/train_step.py [--tiny] [--steps 20] [--warmup 3] [--arch dflash|dflash2|dspark]

`--arch dspark` times the DSpark step (Markov and confidence heads, CE + distance to the target's full
distribution from random final hidden states, or `--tv-source topk`) at the same shape: compare the `flex`
entry of $OUT/train_step_dspark.json with $OUT/train_step.json's.

The batches are built by the real loader code (`loader.PackedDataset.build`: anchors, labels, loss weights,
`masks.mask_metadata` per row on the CPU) over an in-memory stand-in for a store (random hidden states), then
pinned; each timed step is what `dflash.train.trainer` does per micro-batch: copy to the GPU, `masks.to_block_mask`,
embedding + compiled drafter under bf16 autocast, chunked lm_head + loss (`loss.block_loss`), backward,
gradient clipping, fused AdamW step.  The baseline is the identical step with the BlockMask made by
`torch.nn.attention.flex_attention.create_block_mask` from the same mask_mod (bench/ only: the package never
calls it).  Results: $OUT/train_step.json.
"""

from __future__ import annotations

import argparse
import os
import time
from contextlib import nullcontext

import numpy as np
import torch

import common  # noqa: F401  (puts the repo root on sys.path)
from common import PEAK_BF16_FLOPS, Results, dims, elapsed, median, part_limit_s, pctl, sync, tiny_mode
from dflash.config import TrainConfig
from dflash.drafter import DrafterConfig, masks
from dflash.target_model.files import default_target_layers
from dflash.train.feeder import DeviceFeeder
from dflash.train.loss import IGNORE, block_loss, chunk_kernel
from dflash.train.step import TrainStep
from step_workload import (
    FLOP_FORMULAS,
    TILE,
    build_batches,
    create_block_mask_baseline,
    live_tiles,
    pin,
    step_flops,
    to_device,
)


def target_layers(d: dict, layers: int) -> list[int]:
    """The target layers a drafter of this depth reads: the shape's own list at its length, else what
    `dflash precompute` captures by default for that many drafter layers (so --layers 3 reads 3 layers)."""
    if len(d["target_layer_ids"]) == layers:
        return d["target_layer_ids"]
    return default_target_layers(d["num_hidden_layers"], layers)


class Bench:
    def __init__(self, args, tiny: bool, device: str, shape: str | None = None, flex_kernel_options: dict | None = None):
        self.args, self.tiny, self.device = args, tiny, device
        d = dims(tiny, shape)
        self.cfg = DrafterConfig(
            hidden_size=d["hidden_size"], num_hidden_layers=args.layers, num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d["num_key_value_heads"], head_dim=d["head_dim"],
            intermediate_size=d["intermediate_size"], vocab_size=d["vocab_size"],
            num_target_layers=d["num_hidden_layers"], target_layer_ids=target_layers(d, args.layers),
            mask_token_id=d["vocab_size"] - 1, block_size=args.block_size,
            layer_types=getattr(args, "layer_types", None), sliding_window=getattr(args, "sliding_window", None))
        if getattr(args, "arch", "dflash") != "dflash":  # --arch dflash2: the released knobs (docs/DESIGN.md §11)
            from dflash.drafter import with_arch

            self.cfg = with_arch(self.cfg, args.arch)
        cuda = torch.device(device).type == "cuda"
        self.compiled = args.compile == "on" or (args.compile == "auto" and cuda)
        dt = torch.bfloat16 if cuda else torch.float32  # as resolved.ResolvedRun.embed_and_head
        g = torch.Generator(device=device).manual_seed(1)
        V, H = self.cfg.vocab_size, self.cfg.hidden_size
        embed = (torch.randn(V, H, device=device, generator=g) * 0.02).to(dt)
        head = (torch.randn(V, H, device=device, generator=g) * 0.02).to(dt)
        # The trainer's own step (dflash.train.step.TrainStep): model, compile, fused AdamW, clipping, loss.
        self.tcfg = TrainConfig(block_size=args.block_size, num_layers=args.layers, lr=1e-4, weight_decay=0.0,
                                betas=(0.9, 0.95), grad_clip=1.0, lm_head_chunk=args.lm_head_chunk,
                                compile="on" if self.compiled else "off", loss_kernel="compiled",
                                arch=getattr(args, "arch", "dflash"), loss=getattr(args, "loss", "ce"),
                                tv_source=getattr(args, "tv_source", "final_hidden"))
        # --arch dspark: the target's final norm for the TV term's target distribution (docs/DESIGN.md §12)
        final_norm = (torch.ones(H, device=device, dtype=dt) if self.tcfg.drafter.arch == "dspark"
                      and self.tcfg.dspark.tv_source == "final_hidden" else None)
        with torch.device(device):  # random init straight on the GPU
            self.train_step = TrainStep(self.cfg, self.tcfg, torch.device(device), 1, embed, head, n_shapes=8,
                                        flex_kernel_options=flex_kernel_options, final_norm=final_norm)
        self.raw, self.opt = self.train_step.raw, self.train_step.optimizer
        self.embed, self.head = embed, head
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext()
        self.n_params = sum(p.numel() for p in self.raw.parameters())

    def step(self, m, make_mask, fused: bool, host_syncs: bool, optimizer_step: bool = True):
        """One optimizer step on one micro-batch already on the device for the comparisons only: the
        create_block_mask baseline (the trainer's step with another mask) and the loop as it ran before
        (host_syncs, not fused: nonzero() and float(denom) syncs, eager loss).  The measured step of
        dflash itself is TrainStep (mode "new" in `timed`)."""
        denom = float(m.loss_weight.sum().double()) if host_syncs else m.loss_weight_sum
        block_mask = make_mask(m.mask)
        with self.autocast:
            block_embeds = torch.nn.functional.embedding(m.block_input_ids, self.embed)
            hidden = self.raw(m.ctx_hidden, block_embeds, m.ctx_positions, m.block_positions, block_mask)
        out = block_loss(hidden, self.head, m.labels, m.loss_weight, block_size=self.cfg.block_size,
                         denom=denom, chunk=self.args.lm_head_chunk,
                         kernel=chunk_kernel(getattr(self.args, "loss_kernel", "compiled") if fused else "compiled",
                                             False, hidden.device, compiled=fused),
                         label_index=None if host_syncs else m.label_index)
        out.loss.backward()
        if not optimizer_step:  # gradient accumulation (variant accum=N): the optimizer runs every N-th
            return out.loss
        if host_syncs:  # before: clip_grad_norm_ scales every gradient in a separate pass
            self.opt.grad_scale = None
            torch.nn.utils.clip_grad_norm_(self.raw.parameters(), 1.0)
        else:  # dflash.train.trainer._clip: the fused AdamW kernel divides by the clipping factor as it reads
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.raw.parameters() if p.grad is not None])
            self.opt.grad_scale = ((norm + 1e-6) / 1.0).clamp_min(1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return out.loss

    def timed(self, batches, make_mask, n: int, mode: str) -> dict:
        """n steps cycling over `batches` (pinned host memory).

        mode "new" (dflash.train.trainer today): feeder.DeviceFeeder copies the next batch on a side stream while
        this one computes, fused loss, no host sync inside the loop; per-step times are CUDA-event
        intervals on the compute stream, the rate is wall time over all n steps (one sync at the end).
        mode "old" (before): the batch copied on the compute stream at the start of each step, eager loss,
        the host syncs of the old loop; "fused_only": the old loop with the fused loss (one change)."""
        from torch._dynamo.utils import counters

        cuda = torch.device(self.device).type == "cuda"
        dev = torch.device(self.device)
        fused, prefetch, host_syncs = mode != "old", mode == "new", mode != "new"
        frames0, graphs0 = counters["frames"]["total"], counters["stats"]["unique_graphs"]
        peaks, losses, reserved, events = [], [], [], []
        own = prefetch and make_mask is masks.to_block_mask  # the trainer's own step
        accum = getattr(self.args, "accum_this", 1) if own else 1
        steps = max(1, n // accum) if own else n
        n = steps * accum
        feeder = DeviceFeeder((batches[i % len(batches)] for i in range(n)), dev, accum) if prefetch else None
        if own:
            obj = self.tcfg.objective
            obj.lm_head_chunk, obj.loss_kernel = self.args.lm_head_chunk, getattr(self.args, "loss_kernel", "compiled")
            self.tcfg.optim.grad_accum = accum
        sync(self.device)
        t0 = time.perf_counter()
        for i in range(steps):
            if cuda:
                torch.cuda.reset_peak_memory_stats(self.device)  # host-side allocator counters: no sync
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                events.append(ev)
            if own:
                vec, _ = self.train_step(feeder.take(), feeder, 1e-4, prefetch=i + 1 < steps)
                losses.append(vec[0] / vec[2])  # ce_sum / weight_sum: the step's loss
            else:
                m = feeder.ready(feeder.take()[0]) if feeder is not None else to_device(batches[i % len(batches)],
                                                                                     self.device)
                loss = self.step(m, make_mask, fused, host_syncs)
                if feeder is not None:
                    feeder.prefetch()
                losses.append(float(loss.detach()) if mode != "new" else loss.detach())  # the old loop synced
            if cuda:
                peaks.append(torch.cuda.max_memory_allocated(self.device) / 2**30)
                reserved.append(torch.cuda.max_memory_reserved(self.device) / 2**30)
        if cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            events.append(ev)
        sync(self.device)
        wall = time.perf_counter() - t0
        if cuda:  # per micro-batch (an accumulated step's time split evenly)
            times = [a.elapsed_time(b) / 1e3 / accum for a, b in zip(events, events[1:]) for _ in range(accum)]
        else:
            times = [wall / n] * n
        return {"times": times, "wall_per_step": wall / n, "peaks": peaks, "losses": [float(x) for x in losses],
                "reserved": reserved, "recompiles": counters["frames"]["total"] - frames0,
                "new_graphs": counters["stats"]["unique_graphs"] - graphs0, "mode": mode}

    def report(self, r: dict, batches, R: int, S: int, Q: int) -> dict:
        fl = [step_flops(self.cfg, R, S, Q, int((b.labels != IGNORE).sum()), live_tiles(b.mask, self.cfg.layer_types))
              for b in batches]
        mean = {k: float(np.mean([f[k] for f in fl])) for k in fl[0]}
        t = r["wall_per_step"]  # throughput: wall time over all steps, nothing synced in between
        ctx = float(np.mean([b.num_ctx_tokens for b in batches]))
        blk = float(np.mean([b.num_block_tokens for b in batches]))
        return {
            "steps": len(r["times"]),
            "mode": r["mode"],
            "step_ms_wall_mean": round(t * 1e3, 2),
            "step_ms_median": round(median(r["times"]) * 1e3, 2),
            "step_ms_p10": round(pctl(r["times"], 0.1) * 1e3, 2),
            "step_ms_p90": round(pctl(r["times"], 0.9) * 1e3, 2),
            "step_ms_all": [round(x * 1e3, 2) for x in r["times"]],
            "ctx_tokens_per_s": round(ctx / t),
            "block_tokens_per_s": round(blk / t),
            "label_tokens_per_s": round(mean["n_labels"] / t),
            "tflop_per_step": round(mean["total"] / 1e12, 3),
            "achieved_tflops": round(mean["total"] / t / 1e12, 1),
            "mfu": round(mean["total"] / t / PEAK_BF16_FLOPS, 4),
            "mfu_strict": round(mean["total_strict"] / t / PEAK_BF16_FLOPS, 4),
            "flops_mean_per_step": {k: (round(v / 1e12, 4) if k not in ("live_tiles", "n_labels") else round(v, 1))
                                    for k, v in mean.items()},
            "peak_mem_gib_max": round(max(r["peaks"]), 3) if r["peaks"] else None,
            "peak_mem_gib_min": round(min(r["peaks"]), 3) if r["peaks"] else None,
            "peak_reserved_gib_max": round(max(r["reserved"]), 3) if r["reserved"] else None,
            "recompiles_after_warmup": r["recompiles"],
            "new_graphs_after_warmup": r["new_graphs"],
            "loss_first_last": [round(r["losses"][0], 4), round(r["losses"][-1], 4)],
        }


def time_fn(fn, device, n: int) -> list[float]:
    out = []
    for _ in range(n):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t)
    return out


def profile_steps(bench: Bench, batches, R: int, tag: str | None = None) -> None:
    """torch.profiler over 3 steps as dflash.train.trainer runs them: the kernels by self device time, to
    $OUT/train_profile_R<R>.txt (where a step's time goes, for the next optimisation)."""
    from torch.profiler import ProfilerActivity, profile

    from common import out_dir

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(bench.device).type == "cuda" else [])
    with profile(activities=acts) as prof:
        bench.timed(batches, masks.to_block_mask, 3, "new")
    avg = prof.key_averages()
    for key in ("self_device_time_total", "self_cuda_time_total", "self_cpu_time_total"):
        try:
            table = avg.table(sort_by=key, row_limit=40, max_name_column_width=90)
            break
        except Exception:  # noqa: BLE001  (the sort key's name changed across torch versions)
            continue
    (out_dir() / f"train_profile_{tag or f'R{R}'}.txt").write_text(table)


def dspark_targets(b, H: int, tv_source: str, vocab: int, seed: int, k: int = 64):
    """Micro-batch `b` with what an --arch dspark step reads beside it: random final hidden states [R, Q, H]
    (bf16, as the loader packs them) or a random stored top-k [R, Q, k]."""
    import dataclasses

    g = torch.Generator().manual_seed(seed)
    R, Q = b.labels.shape
    if tv_source == "final_hidden":
        return dataclasses.replace(b, final_hidden=torch.randn(R, Q, H, generator=g).to(torch.bfloat16))
    ids = torch.randint(0, vocab, (R, Q, k), generator=g)
    return dataclasses.replace(b, topk_ids=ids, topk_logprobs=torch.randn(R, Q, k, generator=g).log_softmax(-1))


def run_config(res: Results, bench: Bench, key: str, R: int, S: int, Q: int, k: int, args, baseline: bool) -> None:
    B = bench.cfg.block_size
    width = bench.cfg.num_features * bench.cfg.hidden_size
    cuda = torch.device(bench.device).type == "cuda"
    t = time.perf_counter()
    window = bench.cfg.sliding_window if bench.cfg.has_sliding else None
    batches, calls, build_s = build_batches(args.batches, R, S, Q, k, B, width, bench.cfg.vocab_size, seed=R * 7 + k,
                                            sliding_window=window)
    if bench.tcfg.drafter.arch == "dspark":
        batches = [dspark_targets(b, bench.cfg.hidden_size, bench.tcfg.dspark.tv_source, bench.cfg.vocab_size, i)
                   for i, b in enumerate(batches)]
    if cuda:
        batches = [pin(b) for b in batches]
    res.set(f"{key}_config", {"rows_per_batch": R, "S": S, "Q": Q, "samples_per_row": k, "block_size": B,
                              "anchors_per_sample": Q // (B * k), "distinct_batches": len(batches),
                              "layers": bench.cfg.num_hidden_layers, "hidden": bench.cfg.hidden_size,
                              "target_layer_ids": bench.cfg.target_layer_ids,
                              "ctx_width": width, "vocab": bench.cfg.vocab_size, "drafter_params": bench.n_params,
                              "compiled": bench.compiled, "lm_head_chunk": args.lm_head_chunk,
                              "batch_build_s": round(time.perf_counter() - t, 2)})

    if key == "flex":
        with res.guard("mask_timing"):
            meta_dev = to_device(batches[0].mask, bench.device)
            reps = 10 if bench.tiny else 20
            md = [t_ for a, kw in calls[: 2 * R] for t_ in time_fn(lambda a=a, kw=kw: masks.mask_metadata(*a, **kw), "cpu", 5)]
            tb = time_fn(lambda: masks.to_block_mask(meta_dev), bench.device, reps)
            cb = time_fn(lambda: create_block_mask_baseline(meta_dev), bench.device, reps)
            bm1, bm2 = masks.to_block_mask(meta_dev), create_block_mask_baseline(meta_dev)
            equal = bool(torch.equal(masks.block_mask_to_dense(bm1), masks.block_mask_to_dense(bm2)))
            res.set("mask_timing", {
                "mask_metadata_ms_per_row_median": round(median(md) * 1e3, 3),
                "mask_metadata_ms_per_row_p90": round(pctl(md, 0.9) * 1e3, 3),
                "loader_build_ms_per_batch_median": round(median(build_s) * 1e3, 1),
                "to_block_mask_ms_median": round(median(tb) * 1e3, 3),
                "create_block_mask_ms_median": round(median(cb) * 1e3, 3),
                "live_tiles_per_row": live_tiles(batches[0].mask) / R,
                "tiles_per_row_dense": (Q // TILE) * ((S + Q) // TILE),
                "block_masks_equal": equal,
                "tile_counts_equal": [int(bm1.kv_num_blocks.sum()), int(bm1.full_kv_num_blocks.sum())]
                == [int(bm2.kv_num_blocks.sum()), int(bm2.full_kv_num_blocks.sum())],
            })

    def measure(name: str, make_mask, mode: str, steps: int, warmup: int) -> dict | None:
        with res.guard(name):
            t = time.perf_counter()
            bench.timed(batches, make_mask, warmup, mode)
            warm = time.perf_counter() - t
            r = bench.timed(batches, make_mask, steps, mode)
            rep = bench.report(r, batches, R, S, Q)
            rep["warmup_s"] = round(warm, 1)
            res.set(name, rep)
            return rep

    rep = measure(key, masks.to_block_mask, "new", args.steps if key == "flex" else max(3, args.steps // 2),
                  args.warmup)
    if key == "flex":
        res.set("flop_formulas", FLOP_FORMULAS)
    if (args.profile and key in ("flex", "rows4")) or getattr(args, "profile_this", False):
        with res.guard("profile"):
            profile_steps(bench, batches, R, key if key.startswith("v_") else None)
    if baseline:
        # before / after of the step's mask changes, same batches, same compiled drafter
        for mode in ("old", "fused_only"):
            measure(f"{key}_{mode}", masks.to_block_mask, mode, args.steps, 2)
        b = measure("baseline_create_block_mask", create_block_mask_baseline, "new", args.steps, 2)
        if b and rep:
            b["ratio_vs_flex"] = round(b["step_ms_wall_mean"] / rep["step_ms_wall_mean"], 3)
            res.set("baseline_create_block_mask", b)
        # the same in a loop with host syncs (the old loop; peers' loops read metrics every step), where
        # create_block_mask's host-side work cannot hide behind the previous step's GPU work
        old = res.data.get(f"{key}_old")
        b = measure("baseline_create_block_mask_old_loop", create_block_mask_baseline, "old", args.steps, 2)
        if b and isinstance(old, dict) and old.get("step_ms_wall_mean"):
            b["ratio_vs_flex_old_loop"] = round(b["step_ms_wall_mean"] / old["step_ms_wall_mean"], 3)
            res.set("baseline_create_block_mask_old_loop", b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on CPU (smoke test of the same code)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batches", type=int, default=None, help="distinct micro-batches cycled through")
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--lm-head-chunk", type=int, default=2048)
    ap.add_argument("--compile", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--arch", default="dflash", choices=["dflash", "dflash2", "dspark"],
                    help="drafter (dflash2 / dspark: $OUT/train_step_<arch>.json; compare its `flex` step with dflash's)")
    ap.add_argument("--tv-source", default="final_hidden", choices=["final_hidden", "topk"],
                    help="--arch dspark: the TV term's target distribution (full from final hidden states, or top-64)")
    ap.add_argument("--loss", default="ce", choices=["ce", "dpace"], help="position weights of the trainer's step")
    ap.add_argument("--profile", action="store_true", default=os.environ.get("BENCH_PROFILE") == "1",
                    help="also write a kernel-time profile of 3 steps to $OUT/train_profile_R1.txt")
    ap.add_argument("--rows-only", action="store_true", default=os.environ.get("BENCH_ROWS_ONLY") == "1",
                    help="skip the 1-row step, its before/after variants and the baselines")
    ap.add_argument("--rows", default=os.environ.get("BENCH_ROWS", "2,4,8"), help="larger micro-batches to measure, in packed rows ('' for none)")
    ap.add_argument("--variants", default=os.environ.get("BENCH_VARIANTS", ""),
                    help="';'-separated step variants, e.g. 'R=8;R=8,chunk=8192;R=4,shape=qwen3-32b' (see parse_variant)")
    args = ap.parse_args()
    tiny = tiny_mode(args.tiny)
    limit = part_limit_s(170)
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    if tiny:
        torch.set_num_threads(1)
        args.layers = min(args.layers, 2)
    args.steps = args.steps or (3 if tiny else 20)
    args.batches = args.batches or (2 if tiny else 4)
    S, Q, k = (512, 256, 4) if tiny else (4096, 4096, 4)
    suffix = f"_{args.tv_source}" if args.arch == "dspark" and args.tv_source != "final_hidden" else ""
    res = Results("train_step" if args.arch == "dflash" else f"train_step_{args.arch}{suffix}", tiny=tiny, device=device,
                  limit_s=limit)
    t = time.perf_counter()
    bench = Bench(args, tiny, device)
    res.set("model_build_s", round(time.perf_counter() - t, 1))
    if not args.rows_only:
        # the create_block_mask / pre-fusion baselines time block_loss, DFlash's loss: not DSpark's
        run_config(res, bench, "flex", 1, S, Q, k, args, baseline=args.arch != "dspark")
    # Larger micro-batches (R packed rows) for MFU headroom, each if the part's time allows a compile.
    args.steps, args.warmup = max(3, args.steps // 2), 2
    for R in [int(x) for x in args.rows.split(",") if x.strip()]:
        spent = elapsed()
        flex = res.data.get("flex") if isinstance(res.data.get("flex"), dict) else {}
        need = 1.3 * float(flex.get("warmup_s") or 30) + 4 * R  # another compile, then a few steps
        if spent + need < limit:
            with res.guard(f"rows{R}"):
                run_config(res, bench, f"rows{R}", R, S, Q, k, args, baseline=False)
        else:
            res.set(f"rows{R}", {"skipped": f"time: {spent:.0f}s of {limit:.0f}s spent, ~{need:.0f}s needed"})
    run_variants(res, bench, args, tiny, device, S, Q, k, limit)
    res.set("wall_s", round(elapsed(), 1))


def parse_variant(spec: str) -> dict:
    """'R=8,chunk=8192,shape=qwen3-32b,autotune=1,fwd=128:64:4:3,bwd=64:128:128:64:8:3,profile=1' -> dict.
    fwd = BLOCK_M:BLOCK_N:num_warps:num_stages; bwd = BLOCK_M1:BLOCK_N1:BLOCK_M2:BLOCK_N2:num_warps:num_stages
    (flex_attention's kernel_options); autotune=1 lets Inductor autotune flex_attention's tiles (matmuls stay
    on cuBLAS); cdt=1 turns on Inductor's coordinate-descent tuning of its generated (element-wise,
    reduction) kernels; accum=N runs the optimizer every N micro-batches (gradient accumulation); loss=triton runs the per-chunk softmax /
    gradient with dflash.train.loss_kernel's Triton kernel (--loss-kernel triton), loss=compiled is the default."""
    out = {"R": 4, "chunk": None, "shape": None, "autotune": False, "flex": {}, "profile": False, "accum": 1,
           "cdt": False, "loss": "compiled"}
    for part in spec.split(","):
        key, _, val = part.strip().partition("=")
        if key == "R":
            out["R"] = int(val)
        elif key == "chunk":
            out["chunk"] = int(val)
        elif key == "shape":
            out["shape"] = val
        elif key == "accum":
            out["accum"] = int(val)
        elif key == "loss":
            if val not in ("compiled", "triton"):
                raise SystemExit(f"loss={val!r} in {spec!r}: compiled or triton")
            out["loss"] = val
        elif key in ("autotune", "profile", "cdt"):
            out[key] = val not in ("0", "")
        elif key == "fwd":
            bm, bn, w, st = (int(x) for x in val.split(":"))
            out["flex"].update(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
        elif key == "bwd":
            m1, n1, m2, n2, w, st = (int(x) for x in val.split(":"))
            out["flex"].update(BLOCK_M1=m1, BLOCK_N1=n1, BLOCK_M2=m2, BLOCK_N2=n2)
            out["flex"].setdefault("num_warps", w)
            out["flex"].setdefault("num_stages", st)
        else:
            raise SystemExit(f"unknown variant key {key!r} in {spec!r}")
    return out


def run_variants(res: Results, bench: Bench, args, tiny: bool, device: str, S: int, Q: int, k: int, limit: float) -> None:
    """$BENCH_VARIANTS / --variants: ';'-separated step configurations (see parse_variant), each measured
    like a rows config; a new shape, flex tile choice or autotuning gets a freshly built, compiled drafter."""
    import gc

    current = (None, False, {}, False)
    for spec in [v.strip() for v in (args.variants or "").split(";") if v.strip()]:
        v = parse_variant(spec)
        key = "v_" + "_".join(p.strip().replace("=", "").replace(":", "-") for p in spec.split(","))
        spent = elapsed()
        need = 60 + (90 if v["autotune"] else 0) + 5 * v["R"] + (30 if v["shape"] else 0)
        if spent + need > limit:
            res.set(key, {"skipped": f"time: {spent:.0f}s of {limit:.0f}s spent, ~{need:.0f}s needed"})
            continue
        with res.guard(key):
            want = (v["shape"], v["autotune"], v["flex"], v["cdt"])
            if want != current:
                del bench
                gc.collect()
                torch._dynamo.reset()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                import torch._inductor.config as icfg

                icfg.max_autotune = v["autotune"]
                icfg.coordinate_descent_tuning = v["cdt"]
                from dflash.train import loss as dloss

                dloss._COMPILED.clear()  # the loss recompiles under the new Inductor settings
                icfg.max_autotune_gemm_backends = "ATEN" if v["autotune"] else icfg.max_autotune_gemm_backends
                t = time.perf_counter()
                bench = Bench(args, tiny, device, v["shape"], flex_kernel_options=v["flex"] or None)
                res.set(f"{key}_build_s", round(time.perf_counter() - t, 1))
                current = want
            chunk0, args.lm_head_chunk = args.lm_head_chunk, v["chunk"] or args.lm_head_chunk
            args.profile_this, args.accum_this, args.loss_kernel = v["profile"], v["accum"], v["loss"]
            try:
                run_config(res, bench, key, v["R"], S, Q, k, args, baseline=False)
                res.data[f"{key}_config"].update(variant=spec, shape=v["shape"] or "default",
                                                  autotune=v["autotune"], flex_kernel_options=v["flex"],
                                                  accum=v["accum"], coordinate_descent_tuning=v["cdt"],
                                                  loss_kernel=v["loss"])
                res.save()
            finally:
                args.lm_head_chunk, args.profile_this, args.accum_this, args.loss_kernel = chunk0, False, 1, "compiled"


if __name__ == "__main__":
    main()
