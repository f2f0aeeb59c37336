"""The loss's per-chunk softmax / gradient (KD off) on one GPU: the torch.compile'd `loss.chunk_terms`, as
`loss.head_pass` runs it, against the Triton kernel `loss_kernel.fused_ce_terms` at a few tile shapes.

    python bench/loss_kernel.py [--rows 2048,8192] [--configs 4096:8,8192:16] [--iters 20]
    python bench/loss_kernel.py --tiny      # CPU smoke test: Triton's interpreter, small shapes

Each case: bf16 logits [c, V] (random, V = 151936), random labels, decay-like weights with a few zeros.
Times are CUDA events around the call alone (median of --iters after --warmup); the Triton kernel writes
its gradient over the logits, so each of its calls gets a fresh copy, made outside the timed interval.
gb_per_s counts the minimum traffic, 2 bytes read + 2 bytes written per logit.  Each Triton config is
compared with the compiled one: ce_sum (relative), g (max abs, bf16), preds (fraction equal); both with
an fp32 eager reference on the first rows.  Results: $OUT/loss_kernel.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from common import Results, median, tiny_mode  # (also puts the repo root on sys.path)

TINY = tiny_mode("--tiny" in sys.argv)
if TINY:  # Triton binds its language to the interpreter when imported with this set
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from dflash.train import loss as dloss  # noqa: E402
from dflash.train import loss_kernel  # noqa: E402


def inputs(c: int, V: int, device: str, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    logits = (torch.randn(c, V, device=device, generator=g) * 2).to(torch.bfloat16)
    labels = torch.randint(0, V, (c,), device=device, generator=g)
    k = torch.arange(c, device=device) % 16  # block positions: weight 0 at each anchor, as in training
    w = torch.where(k == 0, 0.0, torch.exp(-(k - 1).float() / 7))
    return logits, labels, w


def timed(fn, prep, n: int, warmup: int, cuda: bool) -> list[float]:
    """Seconds of fn(prep()) per call, prep not counted."""
    out = []
    for i in range(warmup + n):
        arg = prep()
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(arg)
            b.record()
            b.synchronize()
            t = a.elapsed_time(b) / 1e3
        else:
            t0 = time.perf_counter()
            fn(arg)
            t = time.perf_counter() - t0
        if i >= warmup:
            out.append(t)
    return out


def compare(a, b, ref_rows: int, ref) -> dict:
    (ce_a, preds_a, g_a), (ce_b, preds_b, g_b) = a, b  # ce: per row
    return {"ce_max_rel_diff": float(((ce_a - ce_b).abs() / ce_b.abs().clamp_min(1e-30)).max()),
            "g_max_abs_diff": float((g_a.float() - g_b.float()).abs().max()),
            "preds_agree": float((preds_a == preds_b).float().mean()),
            "g_max_abs_diff_vs_fp32_first_rows": float((g_a[:ref_rows].float() - ref[3]).abs().max()),
            "preds_agree_vs_fp32_first_rows": float((preds_a[:ref_rows] == ref[2]).float().mean())}


def run_rows(res: Results, c: int, V: int, configs, args, device: str) -> None:
    cuda = device.startswith("cuda")
    logits0, y, w = inputs(c, V, device)
    traffic = 4 * c * V  # bytes: one bf16 read + one bf16 write per logit
    ref_rows = min(c, 256)
    ref = dloss.chunk_terms_eager(logits0[:ref_rows].float(), y[:ref_rows], w[:ref_rows], None, None, 0.0, 1.0)
    terms = dloss._terms_fn("compiled")

    def compiled(x):
        for t in (x, y, w):  # as loss.head_pass does: the short last chunk does not recompile
            torch._dynamo.maybe_mark_dynamic(t, 0)
        ce, _, preds, g = terms(x, y, w, None, None, 0.0, 1.0)
        return ce, preds, g

    base = None
    with res.guard(f"c{c}_compiled"):
        t0 = time.perf_counter()
        base = compiled(logits0)
        first = time.perf_counter() - t0
        ts = timed(compiled, lambda: logits0, args.iters, args.warmup, cuda)
        ms = median(ts) * 1e3
        res.set(f"c{c}_compiled", {"ms_median": round(ms, 3), "ms_min": round(min(ts) * 1e3, 3),
                                   "gb_per_s": round(traffic / (ms / 1e3) / 1e9, 1),
                                   "first_call_s": round(first, 2),
                                   "ce_sum": float(base[0].sum()),
                                   "g_max_abs_diff_vs_fp32_first_rows": float((base[2][:ref_rows].float() - ref[3]).abs().max()),
                                   "preds_agree_vs_fp32_first_rows": float((base[1][:ref_rows] == ref[2]).float().mean())})
    buf = torch.empty_like(logits0)

    def fresh():
        buf.copy_(logits0)
        return buf

    for block, warps in configs:
        key = f"c{c}_triton_B{block}_w{warps}"
        with res.guard(key):
            def fn(x, block=block, warps=warps):  # this iteration's config, bound now
                return loss_kernel.fused_ce_terms(x, y, w, block=block, num_warps=warps)

            t0 = time.perf_counter()
            out = fn(fresh())
            first = time.perf_counter() - t0
            r = {"block": block, "num_warps": warps, "first_call_s": round(first, 2), "ce_sum": float(out[0].sum())}
            if base is not None:
                r.update(compare(out, base, ref_rows, ref))
            del out
            ts = timed(fn, fresh, args.iters, args.warmup, cuda)
            ms = median(ts) * 1e3
            r.update(ms_median=round(ms, 3), ms_min=round(min(ts) * 1e3, 3),
                     gb_per_s=round(traffic / (ms / 1e3) / 1e9, 1))
            if isinstance(res.data.get(f"c{c}_compiled"), dict) and "ms_median" in res.data[f"c{c}_compiled"]:
                r["speedup_vs_compiled"] = round(res.data[f"c{c}_compiled"]["ms_median"] / ms, 2)
            res.set(key, r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU, Triton's interpreter, small shapes (smoke test)")
    ap.add_argument("--rows", default=None, help="chunk row counts, comma-separated (default 2048,8192)")
    ap.add_argument("--vocab", type=int, default=None, help="default 151936 (Qwen3)")
    ap.add_argument("--configs", default=None,
                    help="Triton BLOCK:num_warps pairs, comma-separated (default: the module's, then a few others)")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    args = ap.parse_args()
    device = "cpu" if TINY or not torch.cuda.is_available() else "cuda:0"
    if device == "cpu" and not TINY:
        raise SystemExit("no GPU: run with --tiny for the CPU smoke test")
    if not loss_kernel.available():
        raise SystemExit("triton is not installed")
    rows = [int(x) for x in (args.rows or ("8,33" if TINY else "2048,8192")).split(",")]
    V = args.vocab or (3001 if TINY else 151936)
    default = "512:4,1024:4" if TINY else f"{loss_kernel.BLOCK}:{loss_kernel.NUM_WARPS},8192:16,8192:8,2048:4,16384:16"
    configs = []
    for part in (args.configs or default).split(","):
        b, wp = (int(x) for x in part.split(":"))
        if (b, wp) not in configs:
            configs.append((b, wp))
    args.iters = args.iters or (2 if TINY else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if TINY else 5)
    if TINY:
        torch.set_num_threads(1)
    res = Results("loss_kernel", tiny=TINY, device=device, vocab=V, rows=rows, configs=configs,
                  iters=args.iters, warmup=args.warmup,
                  triton=getattr(loss_kernel.triton, "__version__", None),
                  interpret=loss_kernel.interpret_mode())
    for c in rows:
        run_rows(res, c, V, configs, args, device)
        if device != "cpu":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
