"""Where a training run's wall time went, from its metrics.jsonl: step times, data waits, evals.

    python bench/step_times.py RUN/metrics.jsonl [--first 3300] [--last 4999]

A step's wall time is ctx_tokens / ctx_tokens_per_s (what the trainer timed, data wait included).  Steps
are split into those right after a held-out eval (eval_tau in the previous record: the eval, and the
checkpoint saved at the same step, land in the next step's time), those that waited on the loader for most
of their time (data_wait_frac > 0.5) and the rest, which are split again by samples per step (a step of
many short samples has more blocks, so more work).
"""

from __future__ import annotations

import argparse
import json
import statistics


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("metrics")
    ap.add_argument("--first", type=int, default=1)
    ap.add_argument("--last", type=int, default=10**9)
    a = ap.parse_args()
    recs = [json.loads(x) for x in open(a.metrics) if x.strip()]
    recs = [r for r in recs if a.first <= r["step"] <= a.last and r.get("ctx_tokens_per_s")]
    for r in recs:
        r["wall"] = r["ctx_tokens"] / r["ctx_tokens_per_s"]
    total = sum(r["wall"] for r in recs)
    evaluated = {r["step"] for r in recs if "eval_tau" in r}
    evals = [r for r in recs if r["step"] - 1 in evaluated]
    starved = [r for r in recs if r["step"] - 1 not in evaluated and r["data_wait_frac"] > 0.5]
    rest = [r for r in recs if r["step"] - 1 not in evaluated and r["data_wait_frac"] <= 0.5]
    walls = sorted(r["wall"] for r in recs)
    q = {p: walls[min(len(walls) - 1, int(p * len(walls)))] for p in (0.1, 0.5, 0.75, 0.9, 0.99)}
    print(f"steps {recs[0]['step']}-{recs[-1]['step']}: {len(recs)} steps in {total:.1f} s "
          f"({len(recs) / total:.2f} steps/s); step wall s " + ", ".join(f"p{int(p * 100)} {v:.4f}" for p, v in q.items()))
    for name, rs in (("after a held-out eval", evals), ("loader-starved (data wait > 50%)", starved), ("the rest", rest)):
        t = sum(r["wall"] for r in rs)
        lost = t - len(rs) * q[0.5]
        print(f"  {name}: {len(rs)} steps, {t:.1f} s ({100 * t / total:.0f}%), {lost:.1f} s over the median step")
    cut = statistics.median(r["samples"] for r in rest)
    for name, rs in (("<= median samples", [r for r in rest if r["samples"] <= cut]),
                     ("> median samples", [r for r in rest if r["samples"] > cut])):
        if rs:
            mean = {k: statistics.mean(r[k] for r in rs) for k in ("samples", "ctx_tokens", "host_loss_frac")}
            blocks = statistics.mean(r["block_tokens_per_s"] * r["wall"] for r in rs)
            print(f"    {name} ({cut:g}): {len(rs)} steps, median {statistics.median(r['wall'] for r in rs):.4f} s, "
                  f"{mean['samples']:.1f} samples, {mean['ctx_tokens']:,.0f} ctx tokens, {blocks:,.0f} block tokens, "
                  f"loss phase {mean['host_loss_frac']:.2f} of the host's time")


if __name__ == "__main__":
    main()
