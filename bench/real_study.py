"""A study on a real target: several training arms from one example's params, online tau along each run.

    cd examples/smollm2 && dvc repro precompute precompute_heldout     # the stores the arms read
    python ../../bench/real_study.py --arm DRG= --arm "DRK=--kd-weight 1" --steps 20000 [--store stores/train] \
        [--eval-every 2000] [--gpus 0] [--lossless] [--out study.json]

Run from an example's directory (its params.yaml gives every option an arm does not change).  Each arm
`NAME=FLAGS` is one `dflash train` of the example's train section with FLAGS added, into `runs/NAME`; all
arms train at once on the same GPUs (a small target's drafter leaves a GPU mostly idle), each walking the
held-out store of the target's own replies every --eval-every steps (`eval_walk_tau`: online tau along the
run, docs/DESIGN.md §6).  With --lossless, each arm's last checkpoint then gets `dflash eval` as the example's
eval section says (the real example's: the lossless online eval, 100 held-out prompts x 128 new tokens).

Minutes, per arm and held-out eval step:
  minutes_alone   the step times summed (ctx_tokens / ctx_tokens_per_s of every metrics record): what the
                  run costs a GPU of its own, compilation and the in-training evals included;
  fair_share      wall time divided by the number of arms training at that moment (read from each run's
                  metrics.jsonl as it grows), what sharing the GPU charged it.
Output: one JSON object (stdout, and --out, or $OUT/real_study.json) with each arm's flags and curve.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path


def parse_arm(text: str) -> tuple[str, list[str]]:
    name, sep, flags = text.partition("=")
    if not sep or not name or "/" in name:
        raise argparse.ArgumentTypeError(f"an arm is NAME=FLAGS (FLAGS may be empty), not {text!r}")
    return name, shlex.split(flags)


def curve(metrics: Path) -> list[dict]:
    """The held-out eval records of one run, each with the minutes its steps took until then."""
    spent, points = 0.0, []
    if not metrics.exists():
        return points
    for line in metrics.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        if r.get("ctx_tokens_per_s"):
            spent += r["ctx_tokens"] / r["ctx_tokens_per_s"] / 60
        if "eval_walk_tau" in r or "eval_tau" in r:
            points.append({"step": r["step"], "eval_walk_tau": r.get("eval_walk_tau"),
                           "eval_tau": r.get("eval_tau"), "minutes_alone": round(spent, 3)})
    return points


def fair_share(alive_at: list[tuple[float, int]]) -> float:
    """Minutes charged to one arm: each interval's wall time over the arms alive in it.
    `alive_at`: (seconds since the last sample, arms training during it) for each sample while it trained."""
    return sum(dt / max(n, 1) for dt, n in alive_at) / 60


def train(args, arms: dict[str, list[str]]) -> dict:
    procs = {}
    for name, flags in arms.items():
        cmd = [sys.executable, "-m", "dflash.cli", "train", "--overwrite", "--out", f"runs/{name}",
               "--store", args.store, "--steps", str(args.steps), "--eval-every", str(args.eval_every),
               "--gpus", args.gpus, *flags]
        log = open(f"runs/{name}.log", "w")
        procs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), cmd)
    charged = {name: [] for name in arms}
    last = time.time()
    while any(p.poll() is None for p, _ in procs.values()):
        time.sleep(args.poll_s)
        now, alive = time.time(), [n for n, (p, _) in procs.items() if p.poll() is None]
        for n in alive:
            charged[n].append((now - last, len(alive)))
        last = now
    return {name: {"command": ["python", *cmd[1:]], "returncode": p.returncode,
                   "fair_share_minutes": round(fair_share(charged[name]), 3),
                   "curve": curve(Path(f"runs/{name}/metrics.jsonl"))} for name, (p, cmd) in procs.items()}


def final_eval(name: str) -> dict:
    """`dflash eval` of the arm's last checkpoint as the example's eval section says: the lossless online eval
    where it names prompts (the real example), else held-out tau on its store."""
    out = Path(f"eval/{name}.json")
    out.parent.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "dflash.cli", "eval", "--run", f"runs/{name}", "--out", str(out), "--no-plots"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    result = json.loads(out.read_text())
    return {"kind": "online" if "online" in result else "held-out", "tau": result["tau"],
            "lossless": result.get("lossless")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", type=parse_arm, action="append", required=True, help="NAME=FLAGS, repeatable")
    ap.add_argument("--store", default="stores/train")
    ap.add_argument("--steps", type=int, required=True, help="each arm's cosine length")
    ap.add_argument("--eval-every", type=int, default=2000)
    ap.add_argument("--gpus", default="0")
    ap.add_argument("--lossless", action="store_true",
                    help="`dflash eval` of each arm's last step (online and lossless-checked where params.yaml names prompts)")
    ap.add_argument("--poll-s", type=float, default=5.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    arms = dict(args.arm)
    if len(arms) != len(args.arm):
        raise SystemExit("real_study.py: two arms share a name")
    if not Path("params.yaml").exists():
        raise SystemExit("real_study.py: run it from an example's directory (no params.yaml here)")
    Path("runs").mkdir(exist_ok=True)
    result = {"steps": args.steps, "store": args.store, "arms": train(args, arms)}
    if args.lossless:
        for name in arms:
            result["arms"][name]["final_eval"] = final_eval(name)
    out = args.out or Path(os.environ.get("OUT") or ".") / "real_study.json"
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
