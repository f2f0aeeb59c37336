"""Do two stages of the chain share one card better than they take it in turn? Runs `dflash generate` and
`dflash precompute` (each with the example's params.yaml and the arguments given) alone, one after the
other, then both at once (after an untimed run of each), and writes the wall seconds of each to `$OUT/overlap.json`:

    cd examples/qwen2.5-coder-0.5b
    python ../../bench/run.py overlap -- --generate "--data data/prompts.jsonl --out /dev/shm/ov/g.jsonl" \
        --precompute "--data data/train.jsonl --out /dev/shm/ov/store"

`together / (generate + precompute)` below ~0.8 says that overlapping the stages (precompute of the
conversations beside the replies' generation) would pay on this card; near 1 says the card is the
bottleneck of both. Each run's outputs are removed before the next; logs go to `--logs`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path


def out_paths(args: list[str]) -> list[Path]:
    """The paths after --out in a command's arguments (removed before each run)."""
    return [Path(args[i + 1]) for i, a in enumerate(args[:-1]) if a == "--out"]


def clear(paths: list[Path]) -> None:
    for p in paths:
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def start(argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)


def run_alone(argv: list[str], log: Path) -> dict:
    t = time.time()
    rc = start(argv, log).wait()
    return {"seconds": round(time.time() - t, 1), "returncode": rc}


def run_together(cmds: dict[str, list[str]], logs: Path) -> dict:
    t = time.time()
    procs = {name: start(argv, logs / f"{name}_together.log") for name, argv in cmds.items()}
    out = {}
    while procs:
        for name, p in list(procs.items()):
            if p.poll() is not None:
                out[name] = {"seconds": round(time.time() - t, 1), "returncode": p.returncode}
                del procs[name]
        time.sleep(0.2)
    out["both"] = {"seconds": round(time.time() - t, 1)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--generate", required=True, help="arguments of `dflash generate`, one string")
    ap.add_argument("--precompute", required=True, help="arguments of `dflash precompute`, one string")
    ap.add_argument("--dflash", default="dflash", help="the command that runs dflash")
    ap.add_argument("--logs", default="overlap-logs")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="time the first runs cold (by default each command runs once untimed first, so that "
                         "neither alone run pays for caches that the later runs find warm)")
    a = ap.parse_args(argv)
    logs = Path(a.logs)
    logs.mkdir(parents=True, exist_ok=True)
    cmds = {name: shlex.split(a.dflash) + [name] + shlex.split(extra)
            for name, extra in (("generate", a.generate), ("precompute", a.precompute))}
    outs = [p for argv_ in cmds.values() for p in out_paths(argv_)]
    record: dict = {"commands": {k: shlex.join(v) for k, v in cmds.items()}}
    result = Path(os.environ.get("OUT", logs)) / "overlap.json"
    if a.warmup:
        for name, argv_ in cmds.items():
            clear(outs)
            record[f"{name}_warmup"] = run_alone(argv_, logs / f"{name}_warmup.log")
    for name, argv_ in cmds.items():
        clear(outs)
        record[f"{name}_alone"] = run_alone(argv_, logs / f"{name}_alone.log")
        print(json.dumps({name + "_alone": record[f"{name}_alone"]}), flush=True)
        result.write_text(json.dumps(record, indent=1))
    clear(outs)
    record["together"] = run_together(cmds, logs)
    alone = sum(record[f"{n}_alone"]["seconds"] for n in cmds)
    record["together_over_sequence"] = round(record["together"]["both"]["seconds"] / alone, 3)
    print(json.dumps({"together": record["together"], "together_over_sequence": record["together_over_sequence"]}),
          flush=True)
    result.write_text(json.dumps(record, indent=1))
    failed = [k for k, v in record.items() if isinstance(v, dict) and v.get("returncode")]
    failed += [f"{k} (together)" for k, v in record["together"].items() if v.get("returncode")]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
