"""The store's manifest: what produced the store, and whether each shard is finished.

`STORE/manifest.json` is written once, atomically, by the process that starts a precompute run (before
the shard processes start).  It never changes afterwards, so shard processes never race on it: each
shard's status lives in its own file, `STORE/shard-00000/status.json`, written atomically (tmp + fsync +
os.replace) by the one process that owns that shard.  `read_manifest` returns the merged view (the
manifest with `shards` overlaid by the status files, and by each shard's run statistics kept beside the
store, dflash/store/runinfo.py); that view is what `open_store(...).manifest` is.  Neither file holds a
time, host or rate: the same inputs give the same bytes.
A grown store (dflash/store/parts.py) adds, in that view, `parts` (one summary per part, part 0 the
manifest's own dataset) and counts `num_shards` over all parts; manifest.json itself describes part 0.

Manifest keys (the ones with meaning; anything else is kept as free-form run information):

    format_version      int, FORMAT_VERSION
    target              dflash.target_model.files.target_identity(...) dict
    tokenizer_hash      dflash.target_model.files.tokenizer_hash(...)
    dataset_fingerprint str identifying part 0's input rows (sha256 of the files, or datasets fingerprint)
    target_layer_ids    list[int]
    hidden_dtype        "bf16" | "fp8"
    topk                int (0 = no top-k arrays)
    max_length          int
    final_hidden        true when the shards hold the target's last hidden state (absent: they do not)
    num_shards          int
    shards              {"shard-00000": {"status": "pending" | "running" | "complete", ...stats}}
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from dflash.durable import atomic_write_bytes, disk_full_error, fsync_dir, is_disk_full, read_json
from dflash.errors import StoreError
from dflash.store import parts as P
from dflash.store import runinfo

__all__ = ["atomic_write_bytes", "disk_full_error", "fsync_dir", "is_disk_full"]  # (durable's, re-exported)

FORMAT_VERSION = 2  # 2: part records with conversation keys (dflash/store/parts.py)
MANIFEST = "manifest.json"
STATUS = "status.json"

WEIGHTS_FINGERPRINT = "target weights fingerprint (same architecture, other weights)"

# (manifest key, nested key or None, human name) compared by create_or_check_manifest.
IDENTITY_FIELDS = (
    ("target", "config_hash", "target config hash"),
    ("target", "weights_fingerprint", WEIGHTS_FINGERPRINT),
    ("target", "hidden_size", "target hidden size"),
    ("target", "num_hidden_layers", "target layer count"),
    ("tokenizer_hash", None, "tokenizer / chat template hash"),
    ("dataset_fingerprint", None, "dataset fingerprint"),
    ("target_layer_ids", None, "target_layer_ids"),
    ("hidden_dtype", None, "hidden_dtype"),
    ("topk", None, "topk"),
    ("max_length", None, "max_length"),
    ("final_hidden", None, "final_hidden (--final-hidden)"),
    ("num_shards", None, "num_shards"),
)
# Recorded only when on: a store made without the option, before or after it existed, has no key.
ABSENT_IS_FALSE = ("final_hidden",)


def shard_name(index: int) -> str:
    return f"shard-{int(index):05d}"


# ----------------------------------------------------------------------------------------------------
# manifest


def _get(m: dict, key: str, sub: str | None):
    v = m.get(key)
    if sub is not None:
        v = v.get(sub) if isinstance(v, dict) else None
    return v


# What a part of its own may change (parts.py): the dataset it captured and its shard count.
DATA_FIELDS = ("dataset_fingerprint", "num_shards")
# A checkpoint without safetensors has no weights fingerprint: the field is compared only when both sides
# have it.
IF_RECORDED = ("weights_fingerprint",)


def is_current_format(m) -> bool:
    return isinstance(m, dict) and m.get("format_version") == FORMAT_VERSION


def check_format(m, root: Path) -> None:
    """Refuse a store of another format: there is no reading or converting one, only recapturing it."""
    if not is_current_format(m):
        version = m.get("format_version") if isinstance(m, dict) else None
        raise StoreError(
            f"store {root} has format_version {version!r}, and this dflash reads and writes only "
            f"{FORMAT_VERSION}: recapture it with `dflash precompute --overwrite --out {root}` (or into another --out)."
        )


def manifest_differences(old: dict, new: dict, data: bool = True) -> list[str]:
    """The identity fields in which two manifests differ; without `data`, those that would refuse an append."""
    diffs = []
    for key, sub, name in IDENTITY_FIELDS:
        if not data and key in DATA_FIELDS:
            continue
        a, b = _get(old, key, sub), _get(new, key, sub)
        if (sub or key) in IF_RECORDED and (a is None or b is None):
            continue
        if key in ABSENT_IS_FALSE:
            a, b = bool(a), bool(b)
        if a != b:
            diffs.append(f"{name}: store has {a!r}, this run has {b!r}")
    return diffs


def create_or_check_manifest(store_path: str | os.PathLike, manifest: dict, overwrite: bool = False,
                             data: bool = True) -> dict:
    """Create STORE/manifest.json, or check that an existing store was made by the same inputs (without
    `data`: the same target, tokenizer, layers, dtype, top-k and length, whatever the dataset; parts.py).

    Call it once, in the process that starts the shard processes.  With `overwrite`, an existing store
    directory is deleted first.  Returns the manifest as written (or as found).
    """
    root = Path(store_path)
    mpath = root / MANIFEST
    if overwrite and root.exists():
        # rename first (atomic), delete after: a kill half-way through never leaves a store whose manifest
        # survived the deletion of some of its data
        trash = root.with_name(f".{root.name}.deleting-{os.getpid()}")
        root.rename(trash)
        shutil.rmtree(trash)
    if mpath.is_file():
        old = read_json(mpath)
        check_format(old, root)
        diffs = manifest_differences(old, {"format_version": FORMAT_VERSION, **manifest}, data=data)
        if diffs:
            raise StoreError(
                f"store {root} was written by a different run ({'; '.join(diffs)}). Rerunning continues a "
                "store only with the same inputs; pass --overwrite to start over, or choose another --out."
            )
        return old
    if root.exists() and any(root.iterdir()):
        raise StoreError(
            f"{root} exists, is not empty and has no {MANIFEST}; it is not a dflash store. Choose another "
            "--out, or pass --overwrite to delete it and start over."
        )
    runinfo.forget(root)  # the record of a store deleted before (by --overwrite, or by hand) is not this one's
    m = {"format_version": FORMAT_VERSION, **manifest}
    n = int(m.get("num_shards") or 0)
    m["shards"] = {shard_name(i): {"status": "pending"} for i in range(n)}
    root.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(mpath, (json.dumps(m, indent=2, sort_keys=True, default=str) + "\n").encode())
    return m


def mark_shard(store_path: str | os.PathLike, shard: int, status: str, stats: dict | None = None) -> None:
    """Record a shard's status (and free-form stats) in its own status file; one writer per shard.  Stats
    the data does not decide (timings, rates, the device) go beside the store (runinfo.py)."""
    d = Path(store_path) / shard_name(shard)
    d.mkdir(parents=True, exist_ok=True)
    data, run = runinfo.split_stats(stats or {})
    if run:
        runinfo.write_shard_run(store_path, shard_name(shard), run)
    body = {**data, "status": status}
    atomic_write_bytes(d / STATUS, (json.dumps(body, indent=2, sort_keys=True, default=str) + "\n").encode())


def shard_status(store_path: str | os.PathLike, shard: int) -> dict:
    """The shard's status file, with its latest run's statistics (runinfo.py) merged in."""
    p = Path(store_path) / shard_name(shard) / STATUS
    try:
        status = read_json(p)
    except FileNotFoundError:
        return {"status": "pending"}
    if status.get("status") != "complete":  # its run statistics are written when it completes
        return status
    return {**runinfo.read_shard_run(store_path, shard_name(shard)), **status}


def read_manifest(store_path: str | os.PathLike) -> dict:
    """The manifest with each shard's status file merged in.  StoreError naming the path when missing."""
    root = Path(store_path)
    if not root.is_dir():
        raise StoreError(f"store {root} does not exist; run `dflash precompute --out {root}` first.")
    mpath = root / MANIFEST
    try:
        m = read_json(mpath)
    except FileNotFoundError:
        raise StoreError(
            f"{mpath} does not exist: {root} is not a dflash store (or its precompute never started)."
        ) from None
    check_format(m, root)
    check_manifest(m, mpath)
    parts = P.read_parts(root)
    if parts:  # a grown store: the manifest describes part 0, the part records the rest (parts.py)
        if parts[0].num_shards != m["num_shards"]:
            raise StoreError(f"{P.part_path(root, 0)} says part 0 has {parts[0].num_shards} shards, {mpath} says "
                             f"{m['num_shards']}; one of them was edited. Restore it, or re-run `dflash precompute` "
                             "into a new store.")
        m["parts"] = [p.summary() for p in parts]
        m["num_shards"] = parts[-1].first_shard + parts[-1].num_shards
    m["shards"] = {shard_name(i): shard_status(root, i) for i in range(m["num_shards"])}
    return m


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# key -> (check, what it must be, required); `target.hidden_size` is nested
_MANIFEST_KEYS = (
    ("num_shards", lambda v: _is_int(v) and v >= 1, "a positive integer", True),
    ("target_layer_ids", lambda v: isinstance(v, list) and v and all(_is_int(x) and x >= 0 for x in v),
     "a non-empty list of layer indices (integers >= 0)", True),
    ("target", lambda v: isinstance(v, dict), "an object describing the target", True),
    ("target.hidden_size", lambda v: _is_int(v) and v >= 1, "a positive integer", True),
    ("target.num_hidden_layers", _is_int, "an integer", False),
    ("target.vocab_size", _is_int, "an integer", False),
    ("hidden_dtype", lambda v: v in ("bf16", "fp8"), "'bf16' or 'fp8'", False),
    ("topk", lambda v: _is_int(v) and v >= 0, "an integer >= 0", False),
    ("max_length", _is_int, "an integer", False),
    ("tokenizer_hash", lambda v: isinstance(v, str), "a string", False),
    ("final_hidden", lambda v: v is True, "true (or absent)", False),
)


def check_manifest(m: dict, mpath: Path) -> None:
    """StoreError naming the first key of the manifest that is missing or has the wrong type or value.

    The manifest is written once by precompute and never edited; one that fails here was changed by hand
    or belongs to another tool, and the readers would otherwise fail later with a bare traceback."""
    for key, ok, what, required in _MANIFEST_KEYS:
        parent, _, sub = key.rpartition(".")
        holder = m.get(parent) if parent else m
        if not isinstance(holder, dict):
            continue  # `target` itself is reported
        if sub not in holder:
            if required:
                raise StoreError(
                    f"{mpath} has no `{key}` key; the manifest is damaged or was edited. Precompute writes it "
                    "and never changes it: restore the original file, or re-run `dflash precompute` into a new store."
                )
            continue
        if not ok(holder[sub]):
            raise StoreError(
                f"{mpath}: `{key}` is {holder[sub]!r}, but it must be {what}; the manifest is damaged or was "
                "edited. Precompute writes it and never changes it: restore the original file, or re-run "
                "`dflash precompute` into a new store."
            )
    ids = m["target_layer_ids"]
    if len(set(ids)) != len(ids):
        raise StoreError(f"{mpath}: `target_layer_ids` {ids} repeats a layer; the manifest was edited. Restore "
                         "the original file, or re-run `dflash precompute` into a new store.")
    n = m["target"].get("num_hidden_layers")
    if _is_int(n) and any(x >= n for x in ids):
        raise StoreError(f"{mpath}: `target_layer_ids` {ids} names layers past the target's {n}; the manifest "
                         "was edited. Restore the original file, or re-run `dflash precompute` into a new store.")
    recorded = (m.get("precompute_config") or {}).get("target_layers") if isinstance(m.get("precompute_config"), dict) else None
    if isinstance(recorded, list) and recorded and recorded != ids:
        raise StoreError(
            f"{mpath}: `target_layer_ids` {ids} differs from the layers precompute captured "
            f"(precompute_config.target_layers {recorded}); the manifest was edited. Restore the original "
            "value, or re-run `dflash precompute --target-layers ...` into a new store."
        )


def compare_manifest(manifest: dict, identity: dict, tok_hash: str, target_layer_ids=None) -> None:
    """Refuse a store that does not match the target (and drafter layer choice) a training run uses."""
    tgt = manifest.get("target") or {}
    checks = [
        ("hidden size", tgt.get("hidden_size"), identity.get("hidden_size")),
        ("number of target layers", tgt.get("num_hidden_layers"), identity.get("num_hidden_layers")),
        ("vocab size", tgt.get("vocab_size"), identity.get("vocab_size")),
        ("tokenizer / chat template hash", manifest.get("tokenizer_hash"), tok_hash),
    ]
    ours, theirs = tgt.get("weights_fingerprint"), identity.get("weights_fingerprint")
    if ours is not None and theirs is not None:
        checks.append((WEIGHTS_FINGERPRINT, ours, theirs))
    if target_layer_ids is not None:
        checks.append(("target_layer_ids", list(manifest.get("target_layer_ids") or []), list(target_layer_ids)))
    diffs = [f"{name}: store has {a!r}, expected {b!r}" for name, a, b in checks if a != b]
    if diffs:
        raise StoreError(
            f"the store does not match this target/drafter ({'; '.join(diffs)}). Precompute a store with "
            "this target (and --target-layers), or train with the target the store was made from."
        )


def require_final_hidden(manifest: dict, path) -> None:
    """Refuse to read final hidden states from a store made without them."""
    if manifest.get("final_hidden") is not True:
        raise StoreError(
            f"the store {path} has no final hidden states (the target's last hidden state, which only "
            "`dflash precompute --final-hidden` stores): recapture with `dflash precompute --final-hidden` "
            "(into a new --out, or with --overwrite), or read it without them."
        )
