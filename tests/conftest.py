"""Shared fixtures.  Builders live in helpers.py (importable from any test); fixtures here wrap them."""

from __future__ import annotations

import os
import subprocess
from collections import Counter

# One intra-op thread for every process the tests start (before torch is imported here or in a child):
# pytest-xdist already runs a worker per core (and one more), and each worker's trainers, shard and loader processes
# taking every core made OpenMP's threads spin against each other (the suite ran slower for more CPU).
# dflash's stages honour an explicit OMP_NUM_THREADS.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from helpers import build_store, make_conversations_jsonl, make_tiny_target  # noqa: E402


@pytest.hookimpl(wrapper=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): one pytest-xdist worker more than pytest-xdist's own count (one per
    core), unless PYTEST_XDIST_AUTO_NUM_WORKERS sets it.  Much of a worker's time goes to waiting on the
    subprocesses it starts (their interpreter start-up, a kill point, a rendezvous), with every process on
    one intra-op thread: on a 2-core machine 3 workers ran the suite in 521 s and 544 s, 2 in 565 s and 588 s."""
    n = yield
    return n if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS") else n + 1


def pytest_collection_modifyitems(config, items):
    """Files with the most slow tests first (stable otherwise): with --dist loadfile a worker takes a file
    at a time, and a long file handed out last leaves the other cores idle at the end of the run.  pyproject's
    addopts pass --no-loadscope-reorder, or pytest-xdist would hand out the files with the most tests first
    instead, whatever their length."""
    def file_of(item):
        return item.nodeid.split("::")[0]

    slow = Counter(file_of(item) for item in items if item.get_closest_marker("slow"))
    first = {f: n for n, f in enumerate(dict.fromkeys(map(file_of, items)))}
    items.sort(key=lambda item: (-slow[file_of(item)], first[file_of(item)]))


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """A 4-layer, hidden-64 random-init Qwen3 target directory with a Qwen3-like chat template."""
    return make_tiny_target(tmp_path_factory.mktemp("tiny_target"), arch="qwen3")


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory, tiny_target):
    """(target dir, data jsonl, store dir): 24 conversations precomputed on CPU, layers [1, 2], top-4.

    Session-scoped and shared: treat it as read-only.
    """
    d = tmp_path_factory.mktemp("tiny_store")
    data = make_conversations_jsonl(d / "chats.jsonl", 24)
    store = build_store(d / "store", tiny_target, data, writer="thread")
    return tiny_target, data, store


def built_once(tmp_path_factory, name: str, build):
    """`build(directory)` once for the whole run, not once per pytest-xdist worker: the workers share their
    parent temporary directory, and the first to come builds under a lock while the others wait.  Return
    what `build` returned (a JSON-able value).  Treat what it built as read-only."""
    import fcntl
    import json

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this run's, shared by its workers (basetemp is popen-gwN inside it)
    done = root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_file():
            done.write_text(json.dumps(build(root / name)))
    return json.loads(done.read_text())


@pytest.fixture(scope="session")
def counting_store(tmp_path_factory):
    """(target dir, store dir): train_fixtures.build_counting_store(n=48), the taught target; read-only."""
    from pathlib import Path

    from train_fixtures import build_counting_store

    got = built_once(tmp_path_factory, "counting48", lambda d: [str(p) for p in build_counting_store(d, n=48)])
    return tuple(Path(p) for p in got)


@pytest.fixture
def full_disk(tmp_path):
    """A 200 KiB tmpfs (root only): writes past it fail with a real ENOSPC."""
    d = tmp_path / "tmpfs"
    d.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(d)], capture_output=True)
    except OSError:
        r = None
    if r is None or r.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root); the fsync fault-injection tests cover the messages")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=False)
