"""Zarr object writes from several threads: through zarr's synchronous API against each thread's own
event loop (what ShardWriter's I/O threads do).  Zarr's synchronous API runs every caller's coroutine on
its one event-loop thread, so the encoding of a sharded object (filling and copying each inner chunk,
joining them into the object) does not run in parallel however many threads call it.

    python bench/zarr_encode.py [--dir /dev/shm] [--objects 24] [--threads 1 2 4] [--repeats 2]

Writes `--objects` whole objects of 1024 tokens x 20480 bf16 values (40 MB: a Qwen3-8B shard's hidden
states, 5 layers) into a fresh array under --dir (tmpfs by default: the CPU cost, not the disk's).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import zarr
from zarr.storage import LocalStore

WIDTH, INNER, PER_OBJECT = 5 * 4096, 64, 16


def run(where: str, mode: str, threads: int, objects: int) -> float:
    d = tempfile.mkdtemp(dir=where)
    try:
        S = INNER * PER_OBJECT
        arr = zarr.open_group(LocalStore(d), mode="w").create_array(
            name="hidden", shape=(objects * S, WIDTH), dtype="uint16", chunks=(INNER, WIDTH), shards=(S, WIDTH),
            compressors=None, fill_value=0, config={"write_empty_chunks": True})
        x = np.random.default_rng(0).integers(0, 65535, (S, WIDTH), dtype=np.uint16)

        def put(k: int) -> None:
            if mode == "sync":
                arr[k * S : (k + 1) * S] = x
            else:
                asyncio.run(arr.async_array.setitem(slice(k * S, (k + 1) * S), x))

        t = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(put, range(objects)))
        return objects * x.nbytes / (time.perf_counter() - t) / 1e9
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--objects", type=int, default=24)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    for rep in range(a.repeats):
        for mode in ("sync", "own_loop"):
            for n in a.threads:
                print(f"repeat {rep}  {mode:8s}  {n} thread(s): {run(a.dir, mode, n, a.objects):.2f} GB/s", flush=True)


if __name__ == "__main__":
    main()
