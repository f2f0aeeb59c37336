"""Stage zero: `dflash generate` rewrites a dataset's assistant turns with the target's own responses.

    run_generate(cfg)
      1. check the options and read every row (a bad row fails before anything is written);
      2. take the output's lock; compare the inputs with the journal's (resume, or refuse / start over);
      3. generate the rows no journal holds: in this process (one device), one process per GPU, or
         through an OpenAI-compatible server; each finished row is appended to a journal;
      4. assemble the output from the journals (atomic rename) and print the summary.

Semantics and the resumption protocol: docs/DESIGN.md §10; the journal: dflash/generate/journal.py.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

from dflash.chat import dataset_fingerprint, read_rows, row_locator
from dflash.config import GenerateConfig
from dflash.errors import ConfigError, DataError
from dflash.generate import journal as jr
from dflash.generate.rows import OVER_MAX_PROMPT, Plan, plan_row
from dflash.locks import dir_lock


def _check_config(cfg: GenerateConfig) -> None:
    for name in ("data", "out"):
        if not getattr(cfg, name):
            raise ConfigError(f"--{name} is required for `dflash generate`.")
    if not cfg.target and not cfg.endpoint and cfg.turns != "none":
        raise ConfigError("`dflash generate` needs --target DIR (in-process) or --endpoint URL (a server).")
    checks = [
        (cfg.max_new_tokens >= 1, "--max-new-tokens must be at least 1"),
        (cfg.temperature >= 0, "--temperature must be 0 (greedy) or positive"),
        (0 < cfg.top_p <= 1, "--top-p must be in (0, 1]"),
        (cfg.concurrency >= 1, "--concurrency must be at least 1"),
        (cfg.batch_size >= 1, "--batch-size must be at least 1"),
        (cfg.batch_tokens >= 1, "--batch-tokens must be at least 1"),
        (cfg.timeout > 0, "--timeout must be positive"),
        (cfg.retries >= 0, "--retries must be 0 or more"),
        (cfg.max_samples is None or cfg.max_samples >= 1, "--max-samples must be at least 1"),
        (cfg.samples >= 1, "--samples must be at least 1"),
        (cfg.max_prompt_tokens is None or cfg.max_prompt_tokens >= 1, "--max-prompt-tokens must be at least 1"),
        (cfg.max_prompt_tokens is None or not cfg.endpoint, "--max-prompt-tokens counts the target's tokens in "
         "process; with --endpoint leave it out and bound the prompts on the server (vLLM's --max-model-len)"),
        (cfg.samples == 1 or cfg.temperature > 0, "--samples > 1 needs --temperature > 0: greedy decoding writes "
         "the same response every time"),
        (cfg.samples == 1 or cfg.turns != "none", "--samples > 1 needs responses to generate, not --turns none"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg + ".")
    if Path(cfg.out).resolve() == Path(cfg.data).resolve():
        raise ConfigError(f"--out {cfg.out} is the dataset itself; write the regenerated rows to another file.")
    if Path(cfg.out).is_dir():
        raise ConfigError(f"--out {cfg.out} is a directory; give the path of the JSON-lines file to write.")


def _target_inputs(target: str) -> dict:
    from dflash.target_model.files import target_identity, tokenizer_hash

    ident = target_identity(target, weights=False)
    weights = sorted((f.name, f.stat().st_size) for f in Path(target).glob("*.safetensors"))
    return {"config_hash": ident["config_hash"], "tokenizer_hash": tokenizer_hash(target),
            "weights": hashlib.sha256(json.dumps(weights).encode()).hexdigest()}


def inputs_of(cfg: GenerateConfig, num_rows: int) -> dict:
    """What the output depends on; a journal made from other inputs is not resumed."""
    d = {"data": dataset_fingerprint(cfg.data, cfg.split, cfg.max_samples), "num_rows": num_rows,
         "turns": cfg.turns, "samples": cfg.samples}
    if cfg.turns == "none":
        return d
    d.update({k: getattr(cfg, k) for k in ("max_new_tokens", "temperature", "top_p", "seed", "thinking")})
    if cfg.max_prompt_tokens is not None:  # absent when unset: journals written before the option still resume
        d["max_prompt_tokens"] = cfg.max_prompt_tokens
    if cfg.endpoint:
        from dflash.generate.endpoint import base_url

        d.update({"endpoint": base_url(cfg.endpoint), "model": cfg.model})
    else:
        d["target"] = _target_inputs(cfg.target)
    return d


def _prepare_work(cfg: GenerateConfig, out: Path, inputs: dict) -> Path:
    """The journal directory for these inputs: resumed, started over, or refused."""
    work = jr.work_dir(out)
    old = jr.read_meta(work)
    if old is not None and old.get("inputs") != inputs and not (cfg.overwrite or cfg.restart_changed):
        changed = sorted(k for k in set(inputs) | set(old.get("inputs", {}))
                         if inputs.get(k) != old.get("inputs", {}).get(k))
        raise ConfigError(
            f"{out} is being generated from other inputs (changed: {', '.join(changed)}; journal {work}). Rerun "
            "with the same options to resume it, pass --overwrite to start over, or choose another --out."
        )
    if old is None and out.exists() and not cfg.overwrite:
        raise ConfigError(
            f"refusing to replace {out}: it was not written by `dflash generate` (no journal at {work}). Pass "
            "--overwrite to replace it, or choose another --out."
        )
    if work.exists() and (cfg.overwrite or (old is not None and old.get("inputs") != inputs)):
        if old is not None and old.get("inputs") != inputs:
            print(f"generate: {out} was made from other inputs; starting it over.", flush=True)
        shutil.rmtree(work)
    if jr.read_meta(work) is None:
        jr.write_meta(work, {"inputs": inputs, "format": "jsonl"})
    return work


def _preflight(cfg: GenerateConfig) -> None:
    """What can be refused without generating, refused before anything is written: the thinking switch
    against the template, the server and its model name."""
    if cfg.turns == "none":
        return
    if cfg.target:
        from dflash.generate.local import check_thinking
        from dflash.target_model.capture import load_tokenizer

        check_thinking(load_tokenizer(cfg.target, cfg.trust_remote_code), cfg.thinking, f"target {cfg.target}")
    if cfg.endpoint:
        from dflash.generate.endpoint import resolve_model

        resolve_model(cfg.endpoint, cfg.model, cfg.timeout)


def run_generate(cfg: GenerateConfig) -> dict:
    """Generate (or resume) `cfg.out` and return the summary."""
    _check_config(cfg)
    out = Path(cfg.out)
    with dir_lock(out, "generated dataset", "--out"):
        return _run(cfg, out)


def _run(cfg: GenerateConfig, out: Path) -> dict:
    t0 = time.time()
    ds, broken = read_rows(cfg.data, cfg.split, cfg.max_samples, skip_bad_lines=cfg.skip_bad_rows)
    rows = [dict(r) for r in ds]
    plans, skipped = _plans(cfg, rows, broken)
    if cfg.samples > 1:
        rows, plans = sampled_copies(rows, plans, cfg.samples)
    inputs = inputs_of(cfg, len(rows))
    _preflight(cfg)
    work = _prepare_work(cfg, out, inputs)
    jr.remove_leftovers(out, work)
    _write_skipped(work, skipped)
    done = jr.load_records(work)
    todo = [p for p in plans if done.get(p.row, {}).get("out") is None]
    meta = jr.read_meta(work)
    if not todo and meta.get("sha256") and jr.file_sha256(out) == meta["sha256"]:
        summary = summarize(done, len(rows), 0, 0, time.time() - t0, len(skipped))
        print(f"generate: {out} is already complete ({summary['rows']} rows); nothing to do.", flush=True)
        return summary
    resumed = len(plans) - len(todo)
    if resumed and todo:
        print(f"generate: resuming {out}: {resumed} rows already finished, {len(todo)} to go.", flush=True)
    if todo:
        from dflash.generate.drive import generate_rows

        generate_rows(cfg, work, rows, todo, resumed)
    records = jr.load_records(work)
    sha = jr.assemble(out, records, len(rows))
    summary = summarize(records, len(rows), len(todo), sum(int(records.get(p.row, {}).get("tokens") or 0)
                                                            for p in todo), time.time() - t0, len(skipped))
    jr.write_meta(work, {**meta, "sha256": sha, "summary": summary})
    print_summary(out, summary, work / SKIPPED)
    return summary


SKIPPED = "skipped_rows.jsonl"  # in the journal directory: one {row, file, line, kind, reason} per bad row


def _plans(cfg: GenerateConfig, rows: list[dict], broken: dict) -> tuple[list[Plan], list[dict]]:
    """Each row's plan; with --skip-bad-rows a row that has none (its line is not one JSON object, or
    plan_row refuses it) is left out and listed instead of stopping the run."""
    plans, skipped = [], []
    for i, r in enumerate(rows):
        try:
            if i in broken:
                raise broken[i]
            plans.append(plan_row(r, i, cfg.data, cfg.turns))
        except DataError as e:
            if not cfg.skip_bad_rows:
                raise DataError(f"{e} Or pass --skip-bad-rows to generate the other rows and list this one.") from None
            skipped.append({"row": i, "kind": getattr(e, "kind", "nothing to answer"), "reason": str(e)})
    if skipped:
        locate = row_locator(cfg.data)
        skipped = [{"row": s["row"], **locate(s["row"]), "kind": s["kind"], "reason": s["reason"]} for s in skipped]
    return plans, skipped


def _write_skipped(work: Path, skipped: list[dict]) -> None:
    path = work / SKIPPED
    if skipped or path.exists():
        jr.atomic_write(path, "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in skipped).encode())


def sampled_copies(rows: list[dict], plans: list[Plan], samples: int) -> tuple[list[dict], list[Plan]]:
    """Each row `samples` times, sample-major (every row's .s0, then every row's .s1, ...: a run stopped
    early still covers the dataset once); an `id` gets the suffix .sK so that the copies stay apart.
    Every copy is its own journal row, so the engine seeds it apart from its twins and a resumed run
    skips the copies already done."""
    n = len(rows)

    def copy(row: dict, k: int) -> dict:
        return {**row, "id": f"{row['id']}.s{k}"} if row.get("id") is not None else dict(row)

    out_rows = [copy(rows[i], k) for k in range(samples) for i in range(n)]
    out_plans = [replace(p, row=k * n + p.row) for k in range(samples) for p in plans]
    return out_rows, out_plans


def summarize(records: dict[int, dict], num_rows: int, generated: int, new_tokens: int, wall_s: float,
              skipped: int = 0) -> dict:
    failed = Counter(str(r["failed"]) for r in records.values() if r.get("out") is None and r.get("failed"))
    over = sum(failed.pop(k) for k in [k for k in failed if k.startswith(OVER_MAX_PROMPT)])
    return {
        "rows": sum(1 for r in records.values() if r.get("out") is not None),
        "num_rows": num_rows,
        "generated_now": generated,
        "tokens": sum(int(r.get("tokens") or 0) for r in records.values() if r.get("out") is not None),
        "new_tokens": new_tokens,
        "cut": sum(int(r.get("cut") or 0) for r in records.values() if r.get("out") is not None),
        "failed": dict(sorted(failed.items())),
        "over_max_prompt": over,
        "skipped": skipped,
        "wall_s": round(wall_s, 2),
        "tokens_per_s": round(new_tokens / wall_s, 1) if wall_s > 0 else 0.0,
    }


def print_summary(out: Path, s: dict, report: Path | None = None) -> None:
    fails = sum(s["failed"].values())
    why = "; ".join(f"{n} x {reason}" for reason, n in s["failed"].items())
    print(
        f"generate: {out}: {s['rows']} of {s['num_rows']} rows, {s['tokens']} response tokens; "
        f"{s['cut']} responses cut at --max-new-tokens; {fails} rows failed" + (f" ({why}; left out of the file, "
        "a rerun retries them)" if fails else "") + f"; {s['generated_now']} rows generated now in "
        f"{s['wall_s']:.1f}s ({s['tokens_per_s']:.0f} tokens/s)"
        + (f"; left out {s['over_max_prompt']} rows whose prompt is over --max-prompt-tokens"
           if s.get("over_max_prompt") else "")
        + (f"; left out {s['skipped']} bad rows (--skip-bad-rows; listed in {report})" if s.get("skipped") else ""),
        file=sys.stdout, flush=True,
    )


__all__ = ["run_generate", "inputs_of", "summarize", "sampled_copies"]
