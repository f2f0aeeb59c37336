"""One shard of stage one: its batch plan, the target's capture and the writes, resumable after kill -9.

A shard captures its part's rows `j::num_shards` (j: its place in the part; dflash/store/parts.py) and
stores row r as sample id `id_base + r`; in a one-part store without duplicates that is row i in shard
i % num_shards as sample id i.  A shard renders its rows window by window, sorts each window by length and cuts it into right-padded batches under
`token_budget`.  The batch plan is a pure function of the data and the config, and samples are appended
in plan order, so the committed part of a shard is always a prefix of the plan: a rerun after `kill -9`
recomputes the first unfinished batch exactly as it was (same rows, same padding, same bits) and
appends only what was not committed, giving the store an uninterrupted run gives.

Writes do not stall the GPU: the main thread captures batch i+1 while the store's writer appends and
commits batch i, in a process of its own (`ProcessWritePipeline`, the default: it takes no GIL from the
capture) or on a thread (`WritePipeline`); dflash/store/ says why both are safe.  Results are copied out
through a few reusable pinned host buffers, so host memory stays bounded.
"""

from __future__ import annotations

import fcntl
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from dflash import hostgc
from dflash.chat import load_rows
from dflash.config import PrecomputeConfig
from dflash.precompute.render_pool import RenderPool, auto_workers
from dflash.store import ShardWriter, shard_name
from dflash.store.manifest import shard_status
from dflash.store.parts import Part, part_rows
from dflash.store.pipeline import WritePipeline
from dflash.store.writer_process import ProcessWritePipeline
from dflash.target_model.capture import Capture, linear_attention_note, load_target, load_tokenizer, resolve_dtype

WINDOW = 2048  # rows sorted by length together: long enough to batch well, short enough to start fast


@dataclass
class ShardJob:
    cfg: PrecomputeConfig
    shard: int
    num_shards: int
    device: str
    layer_ids: list[int]
    threads: int = 0  # CPU threads for this process (0 = leave torch's default)
    parent_pid: int | None = None  # spawned shards exit when their launcher is gone
    writer: str | None = None  # process | thread (None: cfg.writer)
    write_slots: int = 3  # host buffers between the GPU and the writer (batches in flight)
    part: Part | None = None  # the part this shard belongs to (None: the whole dataset, as part 0)

    def rows(self, num_rows: int) -> tuple[list[int], int]:
        """(the dataset rows this shard captures, the id of row 0); without a part, every row of the
        dataset, as sample ids."""
        if self.part is None:
            return list(range(self.shard, num_rows, self.num_shards)), 0
        j = self.shard - self.part.first_shard
        return part_rows(self.cfg.out, self.part.index)[j :: self.part.num_shards].tolist(), self.part.id_base



def plan_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Indices into `lengths`, longest first (ties by position), cut so rows x padded length <= budget."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[cur[0]] > token_budget:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def _lock_shard(store: Path, shard: int):
    """One writer per shard: an orphan of a killed launcher still finishing a batch makes a rerun wait."""
    d = store / shard_name(shard)
    d.mkdir(parents=True, exist_ok=True)
    f = open(d / ".lock", "w")
    fcntl.flock(f, fcntl.LOCK_EX)
    return f


def run_shard(job: ShardJob) -> dict:
    """Write one shard; returns its stats.  Resumes a partly written shard, skips a complete one."""
    cfg, shard = job.cfg, job.shard
    t0 = time.time()
    if job.threads:
        torch.set_num_threads(job.threads)
    device = torch.device(job.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tokenizer = load_tokenizer(cfg.target, cfg.trust_remote_code)
    ds = load_rows(cfg.data, cfg.split, cfg.max_samples, check=False, skip_bad_lines=cfg.skip_bad_rows)
    rows, id_base = job.rows(len(ds))
    lock = _lock_shard(Path(cfg.out), shard)
    try:
        if shard_status(cfg.out, shard).get("status") == "complete":
            return shard_status(cfg.out, shard)
        model = load_target(cfg.target, resolve_dtype(cfg.dtype, device), device, cfg.trust_remote_code)
        note = linear_attention_note(model)
        if note and (job.part is None or shard == job.part.first_shard):  # once per run, not per shard
            print(f"precompute: {note}", flush=True)
        _exit_if_orphaned(job)  # loading takes long: a launcher killed meanwhile needs no capture from us
        capture = Capture(model, job.layer_ids, cfg.topk, cfg.lm_head_chunk, cfg.compile, cfg.final_hidden)
        hidden_size = model.config.get_text_config().hidden_size
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        stats = {"rows": len(rows), "skipped": 0, "cut_away": 0, "truncated": 0, "new_samples": 0, "new_tokens": 0}
        writer_args = _writer_args(job, hidden_size)
        capacity = max(cfg.token_budget, cfg.max_length)  # the most tokens one batch can hold
        frozen = False
        workers = cfg.render_workers if cfg.render_workers is not None else auto_workers(device.type, job.num_shards)
        # The render workers start first, the writer process next, and the capture's compile runs while
        # both import: the three start-ups overlap instead of adding up before the first batch.
        with RenderPool(cfg, tokenizer, ds, workers, WINDOW) as pool, \
                open_sink(writer_args, device, job.writer or cfg.writer, job.write_slots, capacity) as sink, \
                hostgc.GcTimer() as gct:
            done = sink.committed_sample_ids()  # resume: the samples already committed
            if len(done) < len(rows):
                capture.warm_up(pad_id)
            t_loop = time.time()
            first = None  # (seconds, tokens) when the first batch was handed to the writer
            bar = tqdm(total=len(rows), desc=f"shard {shard}", unit="sample", position=shard, dynamic_ncols=True, leave=True)
            waits = {"render_wait_s": 0.0, "capture_s": 0.0, "submit_s": 0.0}  # where the loop's time goes
            for rendered in _timed(pool.windows(rows), waits, "render_wait_s"):
                samples = _usable(rendered, stats)
                bar.update(len(rendered) - len(samples))
                for batch in plan_batches([len(rd.input_ids) for _, rd in samples], cfg.token_budget):
                    members = [samples[i] for i in batch]
                    todo = [(j, r, rd) for j, (r, rd) in enumerate(members) if id_base + r not in done]
                    if todo:
                        _write_batch(sink, capture, members, todo, device, pad_id, id_base, waits)
                        if not frozen:  # the model and the compiled top-k exist now: no collection walks them
                            hostgc.freeze()
                            frozen = True
                        stats["new_samples"] += len(todo)
                        stats["new_tokens"] += sum(len(rd.input_ids) for _, _, rd in todo)
                        first = first or (time.time() - t_loop, stats["new_tokens"])
                    bar.update(len(members))
                    elapsed = max(time.time() - t_loop, 1e-9)
                    bar.set_postfix_str(f"{stats['new_tokens'] / elapsed:,.0f} tok/s", refresh=False)
                    _exit_if_orphaned(job)  # the launcher was killed: stop at a batch boundary, a rerun resumes
            bar.close()
            stats["loop_s"] = round(time.time() - t_loop, 3)  # rendering + capture + writes, start-up excluded
            stats.update(_steady(first, stats["loop_s"], stats["new_tokens"]))
            stats.update({k: round(v, 3) for k, v in waits.items()})
            stats["render_workers"] = workers
            stats["wall_s"] = round(time.time() - t0, 3)
            stats["gc_s"] = round(gct.total_s, 3)
            stats["device"] = str(device)
            stats["write_stall_s"] = round(getattr(sink, "stall_s", 0.0), 3)  # the capture waiting for a write slot
            sink.finalize(stats)
        return shard_status(cfg.out, shard)
    finally:
        hostgc.unfreeze()  # when run in the caller's process (tests): leave its GC as it was
        lock.close()


def _writer_args(job: ShardJob, hidden_size: int) -> dict:
    """The shard writer's arguments: what the store of this shard holds and how it commits."""
    cfg = job.cfg
    return dict(store_path=cfg.out, shard_index=job.shard, hidden_width=len(job.layer_ids) * hidden_size,
                num_layers=len(job.layer_ids), hidden_dtype=cfg.hidden_dtype, topk=cfg.topk,
                final_hidden=cfg.final_hidden, commit_every_tokens=cfg.commit_every_tokens,
                chunk_tokens=cfg.store_chunk_tokens)


def _usable(rendered: list, stats: dict) -> list:
    """The rendered rows that have something to learn, counting the others (no reply, or --max-length
    cut every reply away) and the truncated ones in `stats`."""
    samples = []
    for r, rd in rendered:
        if not any(rd.loss_mask):
            stats["cut_away" if rd.truncated else "skipped"] += 1
            continue
        stats["truncated"] += rd.truncated
        samples.append((r, rd))
    return samples


def _steady(first, loop_s: float, tokens: int) -> dict:
    """The loop's rate after its first batch: the waits for the first rendered window and the first
    forward are paid once per shard, and hide the rate a long capture runs at."""
    if first is None:
        return {}
    first_s, first_tokens = first
    rest_s = loop_s - first_s
    out = {"first_batch_s": round(first_s, 3)}
    if rest_s > 0 and tokens > first_tokens:
        out["steady_tok_per_s"] = round((tokens - first_tokens) / rest_s, 1)
    return out


def _exit_if_orphaned(job: ShardJob) -> None:
    if job.parent_pid is not None and os.getppid() != job.parent_pid:
        os._exit(1)


def open_sink(writer_args: dict, device, mode: str = "process", slots: int = 3, capacity_tokens: int = 0):
    """What `_write_batch` sends batches to, a context manager with committed_sample_ids() and
    finalize(stats): the ShardWriter(**writer_args) in a process of its own (ProcessWritePipeline), or on
    a thread of this one (WritePipeline)."""
    if mode == "process":
        return ProcessWritePipeline(writer_args, device, slots=slots, capacity_tokens=capacity_tokens)
    if mode != "thread":
        raise ValueError(f"writer must be process or thread, not {mode!r}")
    return WritePipeline(ShardWriter(**writer_args), device, slots=slots, capacity_tokens=capacity_tokens)


def _batch_ids(members, device, pad_id) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = [len(rd.input_ids) for _, rd in members]
    ids = torch.full((len(members), max(lengths)), pad_id, dtype=torch.long)
    for b, (_, rd) in enumerate(members):
        ids[b, : lengths[b]] = torch.tensor(rd.input_ids)
    lens = torch.tensor(lengths)  # stays on the host: Capture finds the real positions there, sync-free
    if device.type == "cuda":  # no host-device sync here: the GPU may still be busy with the last batch
        return ids.pin_memory().to(device, non_blocking=True), lens
    return ids.to(device), lens


def _timed(it, acc: dict, key: str):
    """`it`'s items, the seconds spent waiting for each added to acc[key]."""
    it = iter(it)
    while True:
        t = time.perf_counter()
        try:
            item = next(it)
        except StopIteration:
            return
        finally:
            acc[key] += time.perf_counter() - t
        yield item


def _write_batch(sink, capture, members, todo, device, pad_id, id_base: int = 0, waits: dict | None = None) -> None:
    """Capture one batch and hand its `todo` rows to the sink's writer.  `waits` adds up the seconds of
    the capture call (the GPU work is queued, so mostly the host's launch and top-k bookkeeping) and of the
    hand-off (the device-to-host copies, and any wait for a free write slot)."""
    device = torch.device(device)
    t = time.perf_counter()
    out = capture(*_batch_ids(members, device, pad_id))
    t1 = time.perf_counter()
    final = {"final_hidden": out["final_hidden"]} if "final_hidden" in out else {}
    sink.submit([(b, id_base + r, r, rd.input_ids, rd.loss_mask) for b, r, rd in todo],
                out["hidden"], out.get("topk_ids"), out.get("topk_logprobs"), **final)
    if waits is not None:
        waits["capture_s"] += t1 - t
        waits["submit_s"] += time.perf_counter() - t1
