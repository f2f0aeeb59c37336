"""What logging one step costs the training thread: `RunLogger.log` (metrics.jsonl, TensorBoard, the bar).

    python bench/step_log.py [--block-size 16] [--steps 2000]

Logs --steps records shaped like a training step's (every field of `metrics.step_record`, per-position
accuracies of a block of --block-size) through the product's `dflash.train.metrics.RunLogger.log` into a
temporary run directory, then closes the TensorBoard writer and reads its events back.  Prints the
milliseconds a record and the scalars TensorBoard holds (tags x points), which must not change with how
they are written.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import common  # noqa: F401  (puts the repo root on sys.path)


def record(step: int, block_size: int) -> dict:
    """A record with the fields and types of metrics.step_record's."""
    return {"step": step, "epoch": 0, "epoch_samples": 17129, "loss": 3.1 - 1e-4 * step, "ce": 3.0, "kd": 0.0,
            "acc": [0.9 - 0.05 * k for k in range(block_size - 1)], "tau": 2.9, "lr": 6e-4, "grad_norm": 0.7,
            "ctx_tokens": 30000, "ctx_tokens_per_s": 7.3e5, "block_tokens_per_s": 1.2e6, "samples": 21,
            "damaged_skipped": 0, "data_wait_frac": 0.004, "gc_frac": 0.0, "host_fwd_frac": 0.22,
            "host_loss_frac": 0.22, "host_bwd_frac": 0.29, "host_opt_frac": 0.06, "host_sync_frac": 0.0004,
            "peak_mem_gb": 6.1, "compiles": 1, "recompiles": 0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2000)
    a = ap.parse_args()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter
    from tqdm import tqdm

    from dflash.train.metrics import RunLogger

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        log = object.__new__(RunLogger)  # the logger's state without a training run's set-up
        log.run, log.records = run, []
        log.file = open(run / "metrics.jsonl", "a")
        log.tb = SummaryWriter(str(run / "tb"))
        log.bar = tqdm(total=a.steps, file=open("/dev/null", "w"))
        t = time.perf_counter()
        for step in range(1, a.steps + 1):
            log.log(record(step, a.block_size))
        per = (time.perf_counter() - t) / a.steps
        log.tb.close()
        log.file.close()
        acc = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0})
        acc.Reload()
        tags = acc.Tags()["scalars"]
        points = {len(acc.Scalars(tag)) for tag in tags}
    print(json.dumps({"ms_per_record": round(per * 1e3, 3), "tags": len(tags), "points_per_tag": sorted(points)}))


if __name__ == "__main__":
    main()
