"""`dflash eval --workers N`: the online prompts decoded by N processes, each a contiguous slice.

Decoding one prompt at a time is bound by kernel launches and the host, not by the device: a small
target leaves a GPU mostly idle, so several processes can share it (or the CPU's cores).  Each worker
loads the checkpoint's drafter and the target itself, decodes its slice with the same code as one
process (`online.decode_prompts`), and writes its records as JSON; the parent merges them in prompt order,
so tau, the outputs and the lossless check are those of one process.  Timings are taken while the
workers share the device, so the speed-up they give is indicative only.

A worker is `python -m dflash.evaluate.workers JOB.json`: JSON in and out (no pickle), its progress a
count in a file beside its output, its failure the parent's one-paragraph error with its stderr's tail.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from dflash.durable import atomic_write_bytes
from dflash.errors import DFlashError


def slices(n: int, workers: int) -> list[tuple[int, int]]:
    """[lo, hi) of each worker's prompts: contiguous, sizes differing by at most one, none empty."""
    workers = max(1, min(workers, n))
    q, r = divmod(n, workers)
    out, lo = [], 0
    for w in range(workers):
        hi = lo + q + (w < r)
        out.append((lo, hi))
        lo = hi
    return out


def run_workers(job: dict, prompts: list[list[int]], refs: list | None, workers: int, progress: bool = True) -> list[dict]:
    """Every prompt's record (online.decode_prompts), decoded by `workers` processes.  `job`: checkpoint,
    target, device, dtype, max_new_tokens, confidence_threshold and seed, as JSON values."""
    parts = slices(len(prompts), workers)
    with tempfile.TemporaryDirectory(prefix="dflash-eval-workers-") as tmp:
        procs = []
        for w, (lo, hi) in enumerate(parts):
            spec = dict(job, prompts=prompts[lo:hi], out=str(Path(tmp) / f"worker{w}.json"),
                        refs=None if refs is None else [None if g is None else {"tokens": g.tokens, "seconds": g.seconds}
                                                            for g in refs[lo:hi]])
            path = Path(tmp) / f"job{w}.json"
            path.write_text(json.dumps(spec))
            err = open(Path(tmp) / f"worker{w}.err", "w+")
            procs.append((subprocess.Popen([sys.executable, "-m", "dflash.evaluate.workers", str(path)],
                                           stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL), err))
        bar = tqdm(total=len(prompts), desc=f"speculative decoding ({len(parts)} workers)", unit="prompt",
                   disable=not progress)
        try:
            while any(p.poll() is None for p, _ in procs):
                _progress(bar, tmp, len(parts))
                failed = [w for w, (p, _) in enumerate(procs) if p.poll() not in (None, 0)]
                if failed:
                    raise _failure(failed[0], procs[failed[0]])
                time.sleep(0.5)
            failed = [w for w, (p, _) in enumerate(procs) if p.returncode != 0]
            if failed:
                raise _failure(failed[0], procs[failed[0]])
            _progress(bar, tmp, len(parts))
        finally:
            bar.close()
            for p, err in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
                err.close()
        records = []
        for w, (lo, _) in enumerate(parts):
            for r in json.loads((Path(tmp) / f"worker{w}.json").read_text()):
                if "mismatch" in r:
                    r["mismatch"]["prompt"] += lo  # the worker counts from its slice's start
                records.append(r)
    return records


def _progress(bar, tmp: str, n: int) -> None:
    done = 0
    for w in range(n):
        try:
            done += int((Path(tmp) / f"worker{w}.json.progress").read_text() or 0)
        except (OSError, ValueError):
            pass
    bar.update(done - bar.n)


def _failure(w: int, proc) -> DFlashError:
    p, err = proc
    err.seek(0)
    tail = " | ".join(line.strip() for line in err.read().strip().splitlines()[-6:])
    return DFlashError(f"eval worker {w} (of --workers) exited with status {p.returncode}: {tail or 'no output'}. "
                       "Rerun with --workers 1 to see the failure in this process.")


def main(job_path: str) -> None:
    import torch

    from dflash.evaluate.export import load_training_drafter
    from dflash.evaluate.online import decode_prompts, eos_token_ids
    from dflash.evaluate.speculative import Generation
    from dflash.target_model.capture import load_target, load_tokenizer

    job = json.loads(Path(job_path).read_text())
    torch.manual_seed(job["seed"])
    device = torch.device(job["device"])
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[job["dtype"]]
    drafter, _, _ = load_training_drafter(job["checkpoint"])
    target = load_target(job["target"], dtype, device)
    drafter.to(device=device, dtype=dtype)
    refs = None if job["refs"] is None else [None if g is None else Generation(tokens=g["tokens"], seconds=g["seconds"])
                                             for g in job["refs"]]
    out = Path(job["out"])
    done = [0]

    def on_prompt():
        done[0] += 1
        out.with_name(out.name + ".progress").write_text(str(done[0]))

    records = decode_prompts(target, drafter, job["prompts"], refs, max_new_tokens=job["max_new_tokens"],
                             eos_ids=eos_token_ids(target, load_tokenizer(job["target"])),
                             confidence_threshold=job["confidence_threshold"], on_prompt=on_prompt)
    atomic_write_bytes(out, json.dumps(records).encode(), durable=False)


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except DFlashError as e:  # its one paragraph is what the parent shows
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
