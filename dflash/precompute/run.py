"""Stage one: run the target over a dataset and write hidden states, top-k and loss masks to a store.

    run_precompute(cfg)
      1. validate every input (target, tokenizer + chat template, layer ids, dataset rows) before the
         store exists, so that bad input leaves nothing behind;
      2. create the manifest, or check that an existing store was made by the same inputs (resume);
      3. run one shard per process: `--shards N` spawns N processes (one per GPU, or CPU), under torchrun
         each global rank is a shard;
      4. print and record a summary.

One shard's work (batch plan, capture, pipelined writes, resume) is dflash/precompute/shard.py.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path

import torch

from dflash.chat import dataset_fingerprint, read_rows
from dflash.config import PrecomputeConfig, to_dict
from dflash.cpu_threads import cpu_threads
from dflash.durable import remove_leftovers
from dflash.errors import ConfigError, DFlashError, StoreError, TargetError, out_of_memory, out_of_memory_message
from dflash.locks import dir_lock
from dflash.paths import portable
from dflash.precompute import space
from dflash.precompute.badrows import REPORT, check_rows
from dflash.precompute.grow import DatasetKeys, plan_parts
from dflash.precompute.shard import ShardJob, run_shard
from dflash.spawned import die_with_parent, raise_failure, supervise
from dflash.store import create_or_check_manifest, read_manifest, runinfo
from dflash.store.manifest import FORMAT_VERSION, MANIFEST, is_current_format, manifest_differences
from dflash.store.parts import PARTS, Part, held_keys, read_parts
from dflash.target_model.capture import check_config_matches_weights, check_layers, load_tokenizer
from dflash.target_model.files import default_target_layers, engine_layer_problem, target_identity, tokenizer_hash

# ---------------------------------------------------------------------------------------------- checks


def _check_config(cfg: PrecomputeConfig, num_shards: int) -> None:
    for name in ("target", "data", "out"):
        if not getattr(cfg, name):
            raise ConfigError(f"--{name} is required for `dflash precompute`.")
    checks = [
        (num_shards >= 1, "--shards must be at least 1"),
        (cfg.max_length >= 2, "--max-length must be at least 2"),
        (cfg.topk >= 0, "--topk must be 0 (off) or positive"),
        (cfg.token_budget >= 1, "--token-budget must be positive"),
        (cfg.lm_head_chunk >= 1, "lm_head_chunk must be positive"),
    ]  # the choices (--hidden-dtype, --dtype, ...) were checked when cfg was built
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg + ".")


def _check_weights(target_dir: Path) -> None:
    """Read the safetensors headers (not the tensors) so a missing or truncated file fails before the store exists."""
    from safetensors import safe_open

    files = sorted(target_dir.glob("*.safetensors"))
    if not files:
        if any(target_dir.glob("*.bin")):
            return  # transformers loads these itself (weights_only)
        raise TargetError(f"target {target_dir} has no weights (*.safetensors); pass a complete checkpoint with --target.")
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                fh.keys()
        except Exception as e:
            raise TargetError(f"target weights {f} cannot be read ({e}); re-download or re-save the checkpoint.") from None


def _held_keys(cfg: PrecomputeConfig, tok_hash: str) -> set[bytes]:
    """The conversations an --append store already holds, rendered by this same tokenizer: the row
    pre-pass skips them.  Empty whenever that is not certain (the store is then checked as new)."""
    out = Path(cfg.out)
    if not cfg.append or cfg.overwrite or not (out / MANIFEST).is_file():
        return set()
    try:
        if read_manifest(out).get("tokenizer_hash") != tok_hash:
            return set()
        return held_keys(out, read_parts(out))
    except DFlashError:  # a damaged store: precompute's own checks say so below
        return set()


def prepare(cfg: PrecomputeConfig, num_shards: int) -> tuple[dict, list[int], DatasetKeys]:
    """Validate everything and return (manifest, layer ids, the rows' keys) without touching the store."""
    _check_config(cfg, num_shards)
    identity = target_identity(cfg.target)
    _check_weights(Path(cfg.target))
    check_config_matches_weights(cfg.target, cfg.trust_remote_code)
    tok_hash = tokenizer_hash(cfg.target)
    tokenizer = load_tokenizer(cfg.target, cfg.trust_remote_code)
    n_layers = int(identity["num_hidden_layers"] or 0)
    if cfg.target_layers:
        layer_ids = list(cfg.target_layers)
    else:  # a shallow target has fewer distinct evenly spaced layers than the drafter has layers
        layer_ids = sorted(set(default_target_layers(n_layers, cfg.num_draft_layers)))
    check_layers(layer_ids, n_layers, cfg.target)
    problem = engine_layer_problem(layer_ids, n_layers)
    if problem:  # a store train would refuse: say so before capturing it (docs/DESIGN.md §2)
        raise ConfigError(f"--target-layers: {problem}")
    ds, broken = read_rows(cfg.data, cfg.split, cfg.max_samples, skip_bad_lines=cfg.skip_bad_rows)
    keys, bad = check_rows(cfg, ds, tokenizer, _held_keys(cfg, tok_hash), broken)
    fingerprint = dataset_fingerprint(cfg.data, cfg.split, cfg.max_samples)
    manifest = {
        "target": {**identity, "path": portable(cfg.target, cfg.out)},
        "tokenizer_hash": tok_hash,
        "dataset_fingerprint": fingerprint,
        "dataset": {"path": portable(cfg.data, cfg.out), "split": cfg.split, "max_samples": cfg.max_samples, "num_rows": len(ds)},
        "target_layer_ids": layer_ids,
        "hidden_dtype": cfg.hidden_dtype,
        "topk": cfg.topk,
        "max_length": cfg.max_length,
        **({"final_hidden": True} if cfg.final_hidden else {}),  # absent = off, as in stores made before it
        "num_shards": num_shards,
        # what decides the store's bytes; how this run went (workers, devices, the store's own path) is in
        # its run record beside the store (dflash/store/runinfo.py)
        "precompute_config": {k: v for k, v in to_dict(cfg).items() if k not in runinfo.RUN_OPTIONS},
    }
    rows = DatasetKeys(keys, fingerprint, bad)
    hidden = identity.get("hidden_size")
    if cfg.space_check and hidden and not (Path(cfg.out) / MANIFEST).is_file():  # a new store: it must fit
        unique, _ = rows.unique()
        per_token = space.feature_bytes_per_token(int(hidden), len(layer_ids), cfg.hidden_dtype, cfg.final_hidden)
        mean = space.tokens_per_row(tokenizer, ds, unique, cfg.data, cfg.max_length)
        problem = space.space_problem(Path(cfg.out), len(unique), mean, per_token)
        if problem:
            raise StoreError(problem)
    return manifest, layer_ids, rows


# ---------------------------------------------------------------------------------------------- launching


def _torchrun_world() -> tuple[int, int, int] | None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    return None


def _devices(gpus: str, n: int, local_offset: int | None = None) -> list[str]:
    """The device of each of `n` shards (or of this rank's shard when `local_offset` is given)."""
    spec = (gpus or "auto").strip().lower()
    if spec not in ("cpu", "auto") and not torch.cuda.is_available():
        raise ConfigError(
            f"--gpus {gpus} asks for GPUs but CUDA is not available in this environment (torch "
            f"{torch.__version__}); run on CPU with --gpus cpu (one CPU process per --shards), or leave "
            "--gpus at auto."
        )
    if spec == "cpu" or not torch.cuda.is_available():
        return ["cpu"] * n
    if spec == "auto":
        ids = list(range(torch.cuda.device_count()))
    else:
        try:
            ids = [int(g) for g in spec.split(",") if g.strip()]
        except ValueError:
            raise ConfigError(f"--gpus {gpus!r}: give GPU indices like 0,1,2, or cpu, or auto.") from None
    if local_offset is not None:
        return [f"cuda:{ids[local_offset % len(ids)]}"]
    if len(ids) < n:
        raise ConfigError(f"--shards {n} needs {n} GPUs but --gpus gives {len(ids)} ({gpus}); one process per GPU.")
    return [f"cuda:{i}" for i in ids[:n]]


def _shard_entry(job: ShardJob, queue) -> None:
    """Body of a spawned shard process: report stats or the error to the launcher."""
    if job.parent_pid is not None:
        die_with_parent(job.parent_pid)  # the launcher holds the store's lock: no writes without it
    try:
        queue.put(("ok", job.shard, run_shard(job)))
    except DFlashError as e:
        queue.put(("user", job.shard, str(e)))
        sys.exit(1)
    except BaseException as e:
        if out_of_memory(e):
            queue.put(("user", job.shard, out_of_memory_message("precompute", e)))
        else:
            queue.put(("bug", job.shard, traceback.format_exc()))
        sys.exit(1)


def _spawn(jobs: list[ShardJob]) -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = {job.shard: ctx.Process(target=_shard_entry, args=(job, queue), daemon=False) for job in jobs}
    for p in procs.values():
        p.start()
    failure = supervise(procs, queue)
    if failure is not None:
        raise_failure(failure, f"shard {failure[1]}",
                      "The run stopped; what the shard committed is kept: rerun the same command to continue.")


def _rank0_first(fn):
    """Under torchrun: rank 0 runs `fn` (manifest creation) and the others learn its outcome."""
    import torch.distributed as dist

    if not dist.is_initialized():
        # The closing barrier waits for the slowest shard, which may take many hours.
        dist.init_process_group("gloo", timeout=datetime.timedelta(days=3))
    outcome = [None]
    if dist.get_rank() == 0:
        try:
            outcome = [("ok", fn())]
        except DFlashError as e:
            outcome = [("error", str(e))]
    dist.broadcast_object_list(outcome, src=0)
    kind, value = outcome[0]
    if kind == "error":
        raise DFlashError(value)
    return value


def summarize(store: str | Path, wall_s: float | None = None) -> dict:
    """Totals over the shards' recorded stats, plus bytes per stored token."""
    m = read_manifest(store)
    tot = {k: 0 for k in ("num_samples", "num_tokens", "num_supervised", "skipped", "cut_away", "truncated", "rows")}
    for st in m["shards"].values():
        for k in tot:
            tot[k] += int(st.get(k) or 0)
    size = sum(f.stat().st_size for f in Path(store).rglob("*") if f.is_file())
    tot["bad_rows"] = sum(int(p.get("bad_rows") or 0) for p in m.get("parts") or [])
    tot["bytes_per_token"] = round(size / tot["num_tokens"], 1) if tot["num_tokens"] else 0.0
    tot["wall_s"] = round(wall_s, 2) if wall_s is not None else max((st.get("wall_s") or 0) for st in m["shards"].values())
    return tot


def _print_summary(store, tot: dict, max_length: int) -> None:
    print(
        f"precompute: {store}: {tot['num_samples']} samples, {tot['num_tokens']} tokens "
        f"({tot['num_supervised']} supervised); skipped {tot['skipped']} without supervised tokens, "
        f"truncated {tot['truncated']} to {max_length} tokens"
        + (f" and {tot['cut_away']} more that --max-length cut before any reply token (not stored)"
           if tot["cut_away"] else "")
        + (f"; left out {tot['bad_rows']} bad rows (--skip-bad-rows; listed in {Path(store) / REPORT})"
           if tot["bad_rows"] else "")
        + f"; {tot['bytes_per_token']:.0f} bytes/token; "
        f"{tot['wall_s']:.1f}s",
        flush=True,
    )


def _inputs_changed(cfg: PrecomputeConfig, out: Path, manifest: dict) -> bool:
    """With --restart-changed (pipelines): an existing store made from other inputs is started over,
    while a store of the same inputs still resumes.  With --append, another dataset is not another input
    (it grows the store); without it, a dataset no part of the store was made from is."""
    if not cfg.restart_changed or not (out / MANIFEST).is_file():
        return False
    old = read_manifest(out)
    parts = old.get("parts") or [{"num_shards": old["num_shards"], "dataset_fingerprint": old.get("dataset_fingerprint")}]
    old["num_shards"] = parts[0]["num_shards"]  # the merged view counts every part's
    diffs = manifest_differences(old, {"format_version": FORMAT_VERSION, **manifest}, data=False)
    if not cfg.append and all(p["dataset_fingerprint"] != manifest["dataset_fingerprint"] for p in parts):
        diffs.append("dataset fingerprint")
    if not cfg.append and parts[0]["dataset_fingerprint"] == manifest["dataset_fingerprint"] \
            and old["num_shards"] != manifest["num_shards"]:
        diffs.append("num_shards")
    if diffs or not is_current_format(old):
        print(f"precompute: {out} was made from other inputs ({'; '.join(diffs) or 'format'}); starting it over.",
              flush=True)
        return True
    return False


def check_overwritable(out: Path) -> None:
    """--overwrite deletes only a dflash store (a manifest.json with a format_version) or an empty directory."""
    if not out.exists() and not out.is_symlink():
        return
    if out.is_dir() and not out.is_symlink():
        if not any(out.iterdir()):
            return
        try:
            m = json.loads((out / MANIFEST).read_text())
        except (OSError, ValueError):
            m = None
        if isinstance(m, dict) and "format_version" in m:
            return
    raise ConfigError(
        f"--overwrite would delete {out}, but it is not a dflash store (no {MANIFEST} written by precompute) "
        "nor an empty directory. Refusing to delete it: remove it yourself if it is yours to delete, or choose "
        "another --out."
    )


def run_precompute(cfg: PrecomputeConfig) -> dict:
    """Validate, create or resume the store, run every shard, and return the summary.

    The store's lock (dflash/locks.py, one writer per store) is taken before anything else touches the
    store: here at once, or under torchrun by rank 0 when it creates the manifest, held to the end."""
    world = _torchrun_world()
    with contextlib.ExitStack() as held:
        if not world:
            _check_config(cfg, cfg.shards)  # --out is given
            held.enter_context(dir_lock(cfg.out, "store", "--out"))
        return _run_precompute(cfg, world, held)


def _run_precompute(cfg: PrecomputeConfig, world, held: contextlib.ExitStack) -> dict:
    t0 = time.time()
    num_shards = world[1] if world else cfg.shards
    manifest, layer_ids, rows = prepare(cfg, num_shards)
    out = Path(cfg.out)

    def create() -> list[dict]:
        """Create or check the manifest and choose the parts to capture (grow.py), as summaries."""
        if world:  # rank 0 under torchrun: refused here, the refusal reaches every rank
            held.enter_context(dir_lock(out, "store", "--out"))
        overwrite = cfg.overwrite or _inputs_changed(cfg, out, manifest)
        if overwrite:
            check_overwritable(out)
        found = create_or_check_manifest(out, manifest, overwrite=overwrite, data=False)
        remove_leftovers(out, out / PARTS)  # a run killed mid-write of its manifest, part record or report
        return [p.summary() for p in plan_parts(cfg, out, found, rows, num_shards)]

    if world:
        import torch.distributed as dist

        rank, world_size, local_rank = world
        owns_group = not dist.is_initialized()
        todo = [Part.from_summary(p) for p in _rank0_first(create)]
        if todo:
            device = _devices(cfg.gpus, 1, local_offset=local_rank)[0]
            for part in todo:
                run_shard(ShardJob(cfg, part.first_shard + rank, world_size, device, layer_ids, part=part))
        dist.barrier()
        if owns_group:
            dist.destroy_process_group()
        if rank != 0:
            return {}
    else:
        devices = _devices(cfg.gpus, num_shards)  # before the store exists: a bad --gpus writes nothing
        todo = [Part.from_summary(p) for p in create()]
        if todo and devices[0] == "cpu":
            print(f"precompute: running {num_shards} shard(s) on CPU (no GPU requested or available).", flush=True)
        for part in todo:
            if num_shards == 1:
                run_shard(ShardJob(cfg, part.first_shard, 1, devices[0], layer_ids, part=part))
            else:
                threads = cpu_threads(num_shards) if devices[0] == "cpu" else 0
                _spawn([ShardJob(cfg, part.first_shard + i, num_shards, devices[i], layer_ids, threads, os.getpid(),
                                 part=part) for i in range(num_shards)])
    tot = summarize(out, time.time() - t0 if todo else None)
    if not todo:
        print(f"precompute: store {out} is already complete ({tot['num_samples']} samples); nothing to do.", flush=True)
    else:
        _record_run(cfg, out, t0, todo, tot)
        _print_summary(out, tot, cfg.max_length)
    return tot


def _record_run(cfg: PrecomputeConfig, out: Path, t0: float, parts: list[Part], tot: dict) -> None:
    """One line of the store's run history (beside the store: when, where, how, how fast)."""
    stamp = lambda t: datetime.datetime.fromtimestamp(t).astimezone().isoformat(timespec="seconds")  # noqa: E731
    options = to_dict(cfg)
    runinfo.record_run(out, {"started": stamp(t0), "finished": stamp(time.time()), "host": socket.gethostname(),
                             "pid": os.getpid(), "options": {k: options[k] for k in runinfo.RUN_OPTIONS},
                             "parts": [p.index for p in parts], **tot})
