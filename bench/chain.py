"""An example's whole chain, stage by stage in `dvc repro`'s order, with each stage's wall time: how long a
drafter takes from nothing on one machine.

    cd examples/smollm2
    python ../../bench/run.py chain -- --until eval            # every stage to `eval`
    python ../../bench/run.py chain -- --skip target,data      # stages already run elsewhere

Each stage's `cmd` from the example's dvc.yaml runs in a shell in the example's folder, in the order the file
lists the stages (both examples list them in an order dvc would run them), or through
`dvc repro --single-item STAGE` with `--dvc`, which also records the lock.  Without `--dvc` nothing needs dvc
installed: a GPU machine that lacks it runs the same commands.  A stage's output goes to `--logs/STAGE.log`;
a failed stage stops the chain.  One JSON line a stage on stdout, and `$OUT/chain.json` (all stages so far,
rewritten after each) for bench/run.py's record.  Each record also keeps the summary lines dflash's commands
print at their end (rows and tokens/s of `generate`, samples and tokens of precompute, steps and tokens/s of
training, the eval's tau and table): a report's rates come from the same file as its minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

# the lines dflash's commands end with (dflash/generate/run.py, dflash/precompute, dflash/train, dflash/cli.py)
SUMMARY = re.compile(r"^(generate: .* rows, |precompute: .* samples, |trained \d+ steps|online tau|offline tau|"
                     r"target: |prompt set |mt-bench |humaneval )")


def summary_lines(log: Path) -> list[str]:
    """The summary lines of a stage's log, progress bars' carriage returns read as line ends."""
    text = log.read_text(errors="replace").replace("\r", "\n")
    return [line.rstrip() for line in text.splitlines() if SUMMARY.match(line)]


def stage_commands(dvc_yaml: Path) -> dict[str, str]:
    stages = yaml.safe_load(dvc_yaml.read_text())["stages"]
    return {name: " ".join(s["cmd"].split()) if isinstance(s["cmd"], str) else " && ".join(s["cmd"])
            for name, s in stages.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dvc-yaml", default="dvc.yaml")
    ap.add_argument("--until", default=None, help="the last stage to run (default: the file's last)")
    ap.add_argument("--skip", default="", help="comma-separated stages not to run")
    ap.add_argument("--dvc", action="store_true", help="run each stage as `dvc repro --single-item STAGE`")
    ap.add_argument("--logs", default="chain-logs")
    a = ap.parse_args(argv)

    commands = stage_commands(Path(a.dvc_yaml))
    if a.until and a.until not in commands:
        sys.exit(f"chain: no stage {a.until!r} in {a.dvc_yaml}; it has {', '.join(commands)}.")
    skip = {s for s in a.skip.split(",") if s}
    logs = Path(a.logs)
    logs.mkdir(parents=True, exist_ok=True)
    out = Path(os.environ.get("OUT", logs)) / "chain.json"
    done: list[dict] = []
    start = time.time()
    for name, cmd in commands.items():
        if name not in skip:
            argv_ = ["dvc", "repro", "--single-item", name] if a.dvc else ["bash", "-c", cmd]
            t = time.time()
            with open(logs / f"{name}.log", "w") as log:
                rc = subprocess.run(argv_, stdout=log, stderr=subprocess.STDOUT).returncode
            record = {"stage": name, "cmd": cmd, "returncode": rc, "seconds": round(time.time() - t, 1),
                      "minutes": round((time.time() - t) / 60, 2), "since_start_min": round((time.time() - start) / 60, 2),
                      "summary": summary_lines(logs / f"{name}.log")}
            done.append(record)
            print(json.dumps(record), flush=True)
            out.write_text(json.dumps({"stages": done, "total_min": round((time.time() - start) / 60, 2)}, indent=1))
            if rc != 0:
                print(f"chain: stage {name} failed (exit {rc}); its output: {logs / (name + '.log')}", file=sys.stderr)
                return rc
        if name == a.until:
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
