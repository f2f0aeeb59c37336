"""Zarr object writes from several threads, the way ShardWriter's I/O threads write `hidden`.

    python bench/zarr_encode.py [--dir /dev/shm] [--objects 24] [--threads 1 2 4] [--per-write 1 6]
        [--modes sync own_loop fused fused_own_loop] [--repeats 2]

Writes `--objects` whole objects of 1024 tokens x 20480 bf16 values (40 MB: a Qwen3-8B shard's hidden
states, 5 layers) into a fresh array under --dir (tmpfs by default: the CPU cost, not the disk's), each
`setitem` covering `--per-write` objects (ShardWriter writes ~6 at a time), from `--threads` threads.
Modes:
  sync            zarr's synchronous API (ShardWriter's default before the fused pipeline)
  own_loop        zarr's async API on each thread's own event loop (measured against the fused pipeline; no gain)
  fused           zarr's synchronous API with zarr 3.4's FusedCodecPipeline (ShardWriter(fused_pipeline=True)):
                  the whole object write (encode + store) runs off zarr's event-loop thread, objects of
                  one setitem in parallel on `codec_pipeline.max_workers` threads
  fused_own_loop  both
Prints GB/s, process CPU seconds per GB, and whether the objects' bytes equal those of the first mode
(the store format must not depend on the path that wrote it).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import zarr
from zarr.storage import LocalStore

WIDTH, INNER, PER_OBJECT = 5 * 4096, 64, 16
FUSED = "zarr.core.codec_pipeline.FusedCodecPipeline"


def has_fused() -> bool:
    try:
        from zarr.core.codec_pipeline import FusedCodecPipeline  # noqa: F401  (zarr >= 3.4)
        return True
    except ImportError:
        return False


def run(where: str, mode: str, threads: int, x: np.ndarray, per_write: int, max_workers: int | None):
    d = tempfile.mkdtemp(dir=where)
    try:
        S = INNER * PER_OBJECT
        objects = len(x) // S
        cfg = {"codec_pipeline.path": FUSED, "codec_pipeline.max_workers": max_workers} if "fused" in mode else {}
        with zarr.config.set(cfg):  # the pipeline is chosen when the array object is made
            arr = zarr.open_group(LocalStore(d), mode="w").create_array(
                name="hidden", shape=(objects * S, WIDTH), dtype="uint16", chunks=(INNER, WIDTH), shards=(S, WIDTH),
                compressors=None, fill_value=0, config={"write_empty_chunks": True})
        assert ("Fused" in type(arr.async_array.codec_pipeline).__name__) == ("fused" in mode)
        starts = range(0, objects, per_write)

        def put(k: int) -> None:
            n = min(per_write, objects - k) * S
            if mode.endswith("own_loop"):
                asyncio.run(arr.async_array.setitem(slice(k * S, k * S + n), x[k * S : k * S + n]))
            else:
                arr[k * S : k * S + n] = x[k * S : k * S + n]

        t, c = time.perf_counter(), time.process_time()
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(put, starts))
        dt, cpu = time.perf_counter() - t, time.process_time() - c
        gb = x.nbytes / 1e9
        h = hashlib.blake2b(digest_size=8)
        for k in (0, objects - 1):
            h.update((Path(d) / "hidden" / "c" / str(k) / "0").read_bytes())
        return gb / dt, cpu / gb, h.hexdigest()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--objects", type=int, default=24)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--per-write", type=int, nargs="+", default=[1, 6])
    ap.add_argument("--modes", nargs="+", default=["sync", "own_loop", "fused", "fused_own_loop"])
    ap.add_argument("--max-workers", type=int, default=None, help="codec_pipeline.max_workers (fused; default: cores)")
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    modes = [m for m in a.modes if "fused" not in m or has_fused()]
    print(f"zarr {zarr.__version__}, numpy {np.__version__}; modes {modes}", flush=True)
    x = np.random.default_rng(0).integers(0, 65535, (a.objects * INNER * PER_OBJECT, WIDTH), dtype=np.uint16)
    run(a.dir, modes[0], max(a.threads), x, max(a.per_write), a.max_workers)  # warm-up: a fresh process's first
    # writes to tmpfs run at a fraction of the later ones' speed, whichever mode makes them
    ref = None
    for rep in range(a.repeats):
        for pw in a.per_write:
            for mode in modes:
                for n in a.threads:
                    gbs, cpu, digest = run(a.dir, mode, n, x, pw, a.max_workers)
                    ref = ref or digest
                    print(f"repeat {rep}  {mode:14s}  {pw} object(s)/write  {n} thread(s): {gbs:5.2f} GB/s  "
                          f"cpu {cpu:.2f} s/GB  bytes {'same' if digest == ref else 'DIFFER'}", flush=True)


if __name__ == "__main__":
    main()
