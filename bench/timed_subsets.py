"""How well the eval's timed prompts stand for their prompt set, from eval JSONs (`dflash eval`'s output).

The speed-up of `dflash eval --batch-size N` comes from `--timed-prompts` prompts of each set decoded alone
both ways.  A speculative decode's time follows its draft steps, so the speed-up those prompts give is the
set's only when their tau (accepted tokens over draft steps) is the set's.  For every prompt set of each
JSON and every count K given, this prints the set's tau, the tau of the K prompts `timed_indices` spreads
over the file, and of the K the eval picks across the set's tau (`tau_strata`), with each one's distance from
the set's; `$OUT/timed_subsets.json` holds the same rows.

    python bench/run.py timed_subsets -- RUN_A/eval/online.json RUN_B/eval/online.json --counts 4,8,16
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.evaluate.prompt_sets import tau_strata, timed_indices  # noqa: E402


def subset_tau(per_prompt: list[dict], idx: list[int]) -> float:
    """The tau of some prompts as the eval sums a set: their accepted tokens over their draft steps."""
    steps = sum(per_prompt[i]["steps"] for i in idx)
    return sum((per_prompt[i]["tau"] or 0.0) * per_prompt[i]["steps"] for i in idx) / max(steps, 1)


def rows_of(path: str, counts: list[int]) -> list[dict]:
    result = json.loads(Path(path).read_text())
    sets = {"held-out": result["online"]} if "online" in result else {}
    sets.update(result.get("bench", {}))
    rows = []
    for name, s in sets.items():
        pp = s["per_prompt"]
        taus = [p["tau"] or 0.0 for p in pp]
        for k in counts:
            spread, strata = subset_tau(pp, timed_indices(len(pp), k)), subset_tau(pp, tau_strata(taus, k))
            rows.append({"eval": path, "set": name, "prompts": len(pp), "tau": s["tau"], "timed": k,
                         "spread_tau": spread, "strata_tau": strata,
                         "spread_off": spread - s["tau"], "strata_off": strata - s["tau"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("evals", nargs="+", help="eval JSONs written by `dflash eval` with per-prompt records")
    ap.add_argument("--counts", default="4,8,16", help="timed prompts per set to compare, comma-separated")
    args = ap.parse_args(argv)
    counts = [int(c) for c in args.counts.split(",")]
    rows = [r for path in args.evals for r in rows_of(path, counts)]
    print(f"{'set':10s} {'prompts':>7s} {'tau':>6s} {'K':>3s} {'spread':>7s} {'off':>6s} {'strata':>7s} {'off':>6s}")
    for r in rows:
        print(f"{r['set']:10s} {r['prompts']:7d} {r['tau']:6.3f} {r['timed']:3d} {r['spread_tau']:7.3f} "
              f"{r['spread_off']:+6.3f} {r['strata_tau']:7.3f} {r['strata_off']:+6.3f}")
    for k in counts:
        of = [r for r in rows if r["timed"] == k]
        print(f"K={k}: largest distance from the set's tau: spread {max(abs(r['spread_off']) for r in of):.3f}, "
              f"strata {max(abs(r['strata_off']) for r in of):.3f}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "timed_subsets.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
