"""Run one benchmark and append its result, in the one schema every report reads, to a JSON-lines file.

    python bench/run.py [--results FILE] [--timeout S] NAME [-- the script's own arguments]
    python bench/run.py --list

NAME is a script of this folder without `.py` (`train_step`, `precompute_bench`, ...).  The script runs in
a subprocess, in the current directory (most scripts expect the repository root; `real_study` an example's
directory), with the repository on PYTHONPATH and `$OUT` pointing at a fresh folder; whatever it leaves
there as JSON (`$OUT/*.json`) and the JSON lines it prints on stdout become the record's `results`.  One
record per run, appended to FILE (default `bench-results.jsonl`, ignored by git):

    {"bench": NAME, "command": [...], "cwd": ..., "date": ISO-8601 UTC, "commit": git HEAD (+ "-dirty"),
     "device": {"gpus": [...], "cpu": ..., "cpus": N, "host": ...},
     "versions": {"python", "torch", "transformers", "zarr", "triton", "cuda"},
     "returncode": N, "wall_s": S, "results": {FILE_STEM: {...}, "stdout": [...]}}

A script killed by `--timeout` still leaves what it measured: the scripts rewrite their `$OUT/<part>.json`
after every measurement.  The reports in benchmarks/ name the command that made their figures.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# Modules the scripts import, not benchmarks of their own.
LIBRARY = {"common", "step_workload", "precompute_workload", "recipe_configs", "host_profile", "run"}


def scripts() -> list[str]:
    return sorted(p.stem for p in HERE.glob("*.py") if p.stem not in LIBRARY)


def commit() -> str:
    def git(*a):
        return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short=12", "HEAD") or "unknown"
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def versions() -> dict:
    """Installed versions, read from the package metadata (importing torch and transformers takes seconds);
    torch's local version names its build (`+cu130`, `+cpu`)."""
    out = {"python": platform.python_version()}
    for dist in ("torch", "transformers", "zarr", "triton"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    build = (out["torch"] or "").partition("+")[2]
    out["cuda"] = build if build.startswith("cu") else None
    return out


def device() -> dict:
    gpus = []
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        gpus = [line.strip() for line in q.stdout.splitlines() if line.strip()]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return {"gpus": gpus, "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "host": platform.node()}


def collect(out_dir: Path, stdout: str) -> dict:
    """The results a script left: each `$OUT/*.json` by its stem, and the JSON lines it printed."""
    results: dict = {}
    for f in sorted(out_dir.glob("*.json")):
        try:
            results[f.stem] = json.loads(f.read_text())
        except ValueError:
            results[f.stem] = {"unreadable": f.name}
    lines = []
    try:  # a script that prints one indented JSON object
        whole = json.loads(stdout)
        results["stdout"] = [whole]
        return results
    except ValueError:
        pass
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith(("{", "[")):
            try:
                lines.append(json.loads(line))
            except ValueError:
                pass
    if lines:
        results["stdout"] = lines
    return results


def run(name: str, argv: list[str], results_file: Path, timeout: float | None) -> dict:
    script = HERE / f"{name}.py"
    if name in LIBRARY or not script.is_file():
        raise SystemExit(f"bench/run.py: no benchmark named {name!r}; one of: {', '.join(scripts())}")
    cmd = [sys.executable, str(script), *argv]
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as tmp:
        env = {**os.environ, "OUT": tmp, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        t0 = time.time()
        try:
            done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, timeout=timeout)
            rc, stdout = done.returncode, done.stdout
        except subprocess.TimeoutExpired as e:
            rc, stdout = 124, e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        sys.stdout.write(stdout)
        record = {"bench": name, "command": ["python", f"bench/{name}.py", *argv], "cwd": os.getcwd(),
                  "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                  "commit": commit(), "device": device(), "versions": versions(), "returncode": rc,
                  "wall_s": round(time.time() - t0, 1), "results": collect(Path(tmp), stdout)}
    with open(results_file, "a") as f:
        f.write(json.dumps(record) + "\n")
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", nargs="?", help="the benchmark, a script of bench/ without .py")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments (after --)")
    ap.add_argument("--results", type=Path, default=Path("bench-results.jsonl"), help="JSON-lines file to append to")
    ap.add_argument("--timeout", type=float, default=None, help="seconds before the script is stopped")
    ap.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    a = ap.parse_args()
    if a.list or not a.name:
        print("\n".join(scripts()))
        return
    argv = a.args[1:] if a.args[:1] == ["--"] else a.args
    rc = run(a.name, argv, a.results, a.timeout)["returncode"]
    sys.exit(rc)


if __name__ == "__main__":
    main()
