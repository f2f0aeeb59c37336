"""From the store to packed training micro-batches: anchors, labels, mask metadata, per the epoch's plan.

An epoch's *plan* (`dflash.train.plan`: packing and order) is a list of micro-batches, each `rows_per_batch`
packed rows of a few samples of similar length; processes split it round-robin, step by step.

The heavy part of a micro-batch (reading hidden states, drawing anchors, building labels, the
closed-form block-sparse mask metadata of `dflash.drafter.masks`) runs in DataLoader worker processes; the
training process only turns the metadata into a BlockMask (masks.to_block_mask).
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import sys

import numpy as np
import torch

from dflash.drafter import masks
from dflash.errors import DamagedSampleError, DataError
from dflash.train.batch import MicroBatch, Packer
from dflash.train.loss import IGNORE, position_weights
from dflash.train.plan import (  # (re-exported below)
    EpochPlan,
    LoaderSpec,
    batch_cost,
    fit_shape,
    plan_epoch,
    round_up,
    shape_set,
)

TILE = masks.TILE


# ---------------------------------------------------------------------------------------------------
# per-sample semantics (docs/DESIGN.md §3)


def eligible_anchors(loss_mask: np.ndarray) -> np.ndarray:
    """Positions a with tokens a and a+1 both supervised (so a + 1 < length holds by construction)."""
    m = np.asarray(loss_mask, dtype=bool)
    return np.flatnonzero(m[:-1] & m[1:])


def draw_anchors(loss_mask: np.ndarray, num_anchors: int, seed: int, epoch: int, sample_id: int) -> np.ndarray:
    """Up to `num_anchors` distinct eligible anchors, sorted; a function of (seed, epoch, sample_id)."""
    cand = eligible_anchors(loss_mask)
    if len(cand) <= num_anchors:
        return cand
    rng = np.random.default_rng([int(seed), int(epoch), int(sample_id)])
    return np.sort(rng.choice(cand, size=num_anchors, replace=False))


def block_targets(input_ids: np.ndarray, loss_mask: np.ndarray, anchors: np.ndarray, block_size: int,
                  mask_token_id: int, weights: np.ndarray) -> dict[str, np.ndarray]:
    """The block stream of one sample: inputs, positions, labels and loss weights, each [n * B].

    Block j: input `[token a_j, MASK x (B-1)]` at positions a_j + k; position k >= 1 is labelled with
    the token at a_j + k when that lies inside the sample and is supervised, else IGNORE (weight 0).
    """
    T, B = len(input_ids), block_size
    k = np.arange(B)
    pos = (anchors[:, None] + k[None, :]).reshape(-1)
    kk = np.tile(k, len(anchors))
    inside = pos < T
    pos_c = np.minimum(pos, T - 1)
    ok = inside & (kk >= 1) & np.asarray(loss_mask, dtype=bool)[pos_c]
    labels = np.where(ok, np.asarray(input_ids)[pos_c], IGNORE)
    inputs = np.where(kk == 0, np.asarray(input_ids)[pos_c], mask_token_id)
    return dict(input_ids=inputs, positions=pos, labels=labels, weights=np.where(ok, weights[kk], 0.0),
                pos_in_block=kk, source=pos_c - 1)  # source: where the target predicted this label


def target_labels(blocks: dict[str, np.ndarray], topk_ids: np.ndarray) -> np.ndarray:
    """The block stream's labels replaced by the target's greedy token where it predicted them: the
    store's top-1 at `source` (top-k is stored sorted), the same positions supervised."""
    labels = blocks["labels"]
    top1 = topk_ids[np.maximum(blocks["source"], 0), 0].astype(labels.dtype)
    return np.where(labels != IGNORE, top1, IGNORE)


def rollout_reach(blocks: dict[str, np.ndarray], input_ids: np.ndarray, topk_ids: np.ndarray,
                  block_size: int) -> np.ndarray:
    """[n * B] bool: the block positions the target's own greedy walk from the anchor reaches with the data's
    tokens as its prefix.  Position k does when the data's tokens at anchor + 1 .. anchor + k - 1 all equal
    the target's greedy token before each (the store's top-1 one position earlier): only there is the
    target's greedy token after the data's prefix (`target_labels`) the token its walk writes at k, which is
    what the engine verifies.  Positions 0 and 1 always do."""
    T, B = len(input_ids), block_size
    pos = blocks["positions"].reshape(-1, B)
    ids = np.asarray(input_ids)
    agree = np.zeros(T, dtype=bool)
    agree[1:] = ids[1:] == topk_ids[: T - 1, 0]
    at = agree[np.minimum(pos, T - 1)] & (pos < T)  # [n, B]: the data agrees with the target at anchor + k
    reach = np.ones_like(at)
    reach[:, 2:] = np.cumprod(at[:, 1:-1], axis=1).astype(bool)
    return reach.reshape(-1)


def target_agreement(store, max_samples: int = 200) -> tuple[float, int] | None:
    """(share, positions): how often the store's supervised tokens equal the target's greedy token before them
    (the stored top-1 one position earlier), over its first `max_samples` samples; None without top-k.  Low
    on data the target did not write: there --labels target / rollout train on what the engine verifies."""
    if not getattr(store, "topk", 0) or len(store) == 0:
        return None
    agree = total = 0
    for sid in store.sample_ids()[:max_samples]:
        d = store.read(sid, fields=("input_ids", "loss_mask", "topk_ids"))
        ids, sup, top1 = d["input_ids"].numpy(), d["loss_mask"].numpy()[1:], d["topk_ids"][:, 0].numpy()
        agree += int(((ids[1:] == top1[:-1]) & sup).sum())
        total += int(sup.sum())
    return (agree / total, total) if total else None


# ---------------------------------------------------------------------------------------------------
# the epoch plan


# ---------------------------------------------------------------------------------------------------
# the dataset (runs in worker processes) and the sampler (main process)


class PackedDataset(torch.utils.data.Dataset):
    """dataset[(epoch, g)] -> micro-batch g of that epoch's plan, a MicroBatch (dflash.train.batch).

    dataset[(epoch, g, seq)] (make_loader with slots): the same micro-batch, its context features in
    batch slot `seq % num_slots` (dflash.train.batch_slots) instead of a tensor: the batch holds `seq` and
    `slot`, and the training process views the slot (DeviceFeeder)."""

    slots = None  # BatchSlots shared with the workers (make_loader), or None: a fresh shared tensor per batch

    def __init__(self, store, spec: LoaderSpec):
        self.store = store
        self.spec = spec
        self.sample_ids = np.asarray(store.sample_ids(), dtype=np.int64)
        self.lengths = np.asarray(store.lengths(), dtype=np.int64)
        nsup = np.asarray(store.num_supervised(), dtype=np.int64)
        self.max_blocks = np.minimum(np.maximum(nsup - 1, 0), spec.max_blocks)
        self.weights = position_weights(spec.block_size, spec.gamma).numpy()

    @functools.lru_cache(maxsize=2)  # noqa: B019  (one dataset per process; plans are small)
    def plan(self, epoch: int) -> EpochPlan:
        return plan_epoch(self.lengths, self.max_blocks, self.spec, epoch)

    def __getitem__(self, key: tuple) -> MicroBatch:
        epoch, g, *seq = key
        return self.build(epoch, self.plan(epoch).batches[g], g, seq=seq[0] if seq else None)

    def _sample_or_skip(self, idx: int, epoch: int) -> dict | None:
        """_sample, or None for a damaged sample under --skip-damaged (said on stderr, counted in the batch)."""
        try:
            return self._sample(idx, epoch)
        except DamagedSampleError as e:
            self._skip(e)
            return None

    def _skip(self, e: DamagedSampleError) -> None:
        """--skip-damaged: one line per skipped sample from the worker that read it (the step counts it);
        without it, the damage stops the run."""
        if not self.spec.skip_damaged:
            raise e
        print(f"dflash train: skipping damaged sample {e.sample_id} in {e.shard} ({e.field} fails its checksum; "
              "`dflash verify` lists them all)", file=sys.stderr, flush=True)

    def _sample(self, idx: int, epoch: int) -> dict:
        spec = self.spec
        sid = int(self.sample_ids[idx])
        # Hidden states are read later, by build(), straight into the packed batch as stored (bf16, or fp8
        # bits and scales: Store.read_hidden_into); a store without that (tests' array stores) gives them here.
        direct = self._direct()
        fields = ["input_ids", "loss_mask"] + ([] if direct else ["hidden"])
        fields += ["topk_ids", "topk_logprobs"] if spec.kd or spec.target_labels else []
        fields += ["final_hidden"] if spec.final_hidden else []
        d = self.store.read(sid, fields=fields)
        T = min(len(d["input_ids"]), spec.s_shapes[-1])  # longer samples are cut to the row budget
        ids = d["input_ids"][:T].numpy()
        lm = d["loss_mask"][:T].numpy().astype(bool)
        anchors = draw_anchors(lm, int(self.max_blocks[idx]), spec.seed, epoch, sid)
        blocks = block_targets(ids, lm, anchors, spec.block_size, spec.mask_token_id, self.weights)
        if spec.target_labels:
            topk = d["topk_ids"][:T].numpy()
            blocks["labels"] = target_labels(blocks, topk)
            if spec.rollout_labels:
                reach = rollout_reach(blocks, ids, topk, spec.block_size)
                blocks["labels"] = np.where(reach, blocks["labels"], IGNORE)
                blocks["weights"] = np.where(reach, blocks["weights"], 0.0)
        out = dict(sid=sid, T=T, hidden=None if direct else d["hidden"][:T], anchors=anchors, **blocks)
        if spec.kd:
            src = torch.from_numpy(np.maximum(blocks["source"], 0))
            out["topk_ids"] = d["topk_ids"][:T][src]
            out["topk_logprobs"] = d["topk_logprobs"][:T][src]
        if spec.final_hidden:  # the family's target distribution: the target's state where it predicted each label
            out["final_hidden"] = d["final_hidden"][:T][torch.from_numpy(np.maximum(blocks["source"], 0))]
        return out

    def _direct(self) -> bool:
        return getattr(self.store, "hidden_dtype", None) in ("bf16", "fp8") and hasattr(self.store, "read_hidden_into")

    def build(self, epoch: int, rows: list[np.ndarray], g: int = -1, seq: int | None = None) -> MicroBatch:
        read = [[self._sample_or_skip(int(i), epoch) for i in row] for row in rows]
        damaged = sum(s is None for row in read for s in row)
        samples = [[s for s in row if s is not None] for row in read]
        S, Q, LH, hidden_dtype, K = self._shape(samples)
        shape = (self.spec.rows_per_batch, S, LH)
        slot = None
        if (seq is not None and self.slots is not None and hidden_dtype in (torch.bfloat16, torch.uint8)
                and self.slots.fits(shape, hidden_dtype)):
            slot = self.slots.acquire(seq)
        ctx = self.slots.view(slot, shape, hidden_dtype) if slot is not None else _batch_tensor(shape, hidden_dtype)
        scale = torch.zeros(*shape[:2], self.store.num_layers) if hidden_dtype == torch.uint8 else None
        final = self.store.hidden_size if self.spec.final_hidden else None
        packer = Packer(ctx, Q, self.spec.block_size, self.spec.mask_token_id, sliding_window=self.spec.sliding_window,
                        topk=K if self.spec.kd else None, final_hidden=final, ctx_scale=scale)
        for row in samples:
            for s in row:
                try:
                    packer.add(s, read_hidden=lambda dest, sc, sid=s["sid"]: self.store.read_hidden_into(sid, dest, sc))
                except DamagedSampleError as e:
                    self._skip(e)
                    damaged += 1
            packer.end_row()
        b = packer.finish(epoch=epoch, index=g, num_damaged=damaged)
        if seq is not None:  # the training process releases every seq in order, slot or not
            b.seq, b.slot = seq, slot
            if slot is not None:  # the features stay in the slot; only its number and shape cross over
                b.ctx_hidden, b.ctx_shape = None, shape
        return b

    def _shape(self, samples: list[list[dict]]) -> tuple[int, int, int, torch.dtype, int]:
        """(S, Q, feature width, feature dtype, top-K) of the micro-batch that packs these rows."""
        spec = self.spec
        S = fit_shape(max(1, max(sum(s["T"] for s in row) for row in samples)), spec.s_shapes)
        Q = fit_shape(max(1, max(sum(len(s["anchors"]) for s in row) for row in samples) * spec.block_size),
                      spec.q_shapes)
        first = next((row[0]["hidden"] for row in samples if row), None)
        LH = first.shape[-1] if first is not None else self.store.hidden_size * self.store.num_layers
        fp8_bits = first is None and self._direct() and self.store.hidden_dtype == "fp8"
        hidden_dtype = first.dtype if first is not None else torch.uint8 if fp8_bits else torch.bfloat16
        K = next((row[0]["topk_ids"].shape[-1] for row in samples if row), 0) if spec.kd else 0
        return S, Q, LH, hidden_dtype, K


def _batch_tensor(shape, dtype) -> torch.Tensor:
    """An uninitialised tensor; in a DataLoader worker, allocated in shared memory straight away (as
    default_collate does), so sending it to the training process does not copy ~170 MB per row again."""
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    storage = torch.UntypedStorage._new_shared(int(np.prod(shape)) * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


class RankSampler(torch.utils.data.Sampler):
    """Keys (epoch, g) of this rank's micro-batches for `steps` optimizer steps from a start point."""

    def __init__(self, dataset: PackedDataset, rank: int, world: int, accum: int, start_epoch: int,
                 start_batch: int, steps: int):
        self.ds, self.rank, self.world, self.accum = dataset, rank, world, accum
        self.start_epoch, self.start_batch, self.steps = start_epoch, start_batch, steps

    def restart(self, start_epoch: int, start_batch: int, steps: int) -> None:
        """The keys of a later span (the next epoch's), for the loader's next iteration over the same workers."""
        self.start_epoch, self.start_batch, self.steps = start_epoch, start_batch, steps

    def step_keys(self):
        """(epoch, first micro-batch, [keys of this rank]) for each step, in order."""
        epoch, g, done, empty = self.start_epoch, self.start_batch, 0, 0
        per_step = self.world * self.accum
        while done < self.steps:
            n = len(self.ds.plan(epoch))
            if g + per_step > n:  # the epoch's tail that cannot feed every process is left out
                epoch, g = epoch + 1, 0
                empty = empty + 1 if n < per_step else 0
                if empty >= 2:
                    raise DataError(
                        f"an epoch of this store packs into {n} micro-batches, fewer than one optimizer step "
                        f"needs ({self.world} processes x {self.accum} accumulation steps); use fewer "
                        "processes, less --grad-accum, a smaller --token-budget or a bigger store."
                    )
                continue
            yield epoch, g, [(epoch, g + a * self.world + self.rank) for a in range(self.accum)]
            g += per_step
            done += 1

    def __iter__(self):
        for _, _, keys in self.step_keys():
            yield from keys

    def __len__(self) -> int:
        return self.steps * self.accum


def steps_per_epoch(dataset: PackedDataset, world: int, accum: int, epoch: int = 0) -> int:
    return len(dataset.plan(epoch)) // (world * accum)


def _worker_init(_, trainer_pid: int | None = None):
    from dflash.spawned import die_with_parent, pid_alive

    die_with_parent(os.getppid())  # the forkserver, which dies with the trainer (train/forkserver_guard.py)
    if trainer_pid is not None and not pid_alive(trainer_pid):  # it died while this worker was starting
        os._exit(1)
    torch.set_num_threads(1)  # workers do light numpy work; leave the cores to the training process


PREFETCH_FACTOR = 4  # micro-batches each worker keeps ready


def batch_bytes(spec: LoaderSpec, hidden_width: int) -> int:
    """Host bytes of one micro-batch's context features at its largest shape (bf16): the bulk of it."""
    return spec.rows_per_batch * spec.s_shapes[-1] * hidden_width * 2


class _Numbered(torch.utils.data.Sampler):
    """A sampler's keys with their position appended: (epoch, g) -> (epoch, g, seq), for batch slots."""

    def __init__(self, sampler):
        self.sampler = sampler

    def __iter__(self):
        for seq, key in enumerate(self.sampler):
            yield (*key, seq)

    def __len__(self) -> int:
        return len(self.sampler)


def worker_context():
    """The loader workers' start method: forkserver, with the trainer's temporary folder made first.

    multiprocessing makes that folder on first use (the forkserver's socket, a worker's handle to a
    shared tensor).  A worker whose process object is made before it exists makes a folder of its own and
    removes it on its way out while its queue thread may still be sending: `Directory not empty`, a
    traceback after a failed run's one-paragraph message.  Made here first, every worker inherits the
    trainer's, which only the trainer removes, once its workers are joined."""
    import multiprocessing.util

    multiprocessing.util.get_temp_dir()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "numpy", "dflash.train.loader", "dflash.train.forkserver_guard"])
    return ctx


def make_loader(dataset: PackedDataset, sampler: RankSampler, num_workers: int, pin_memory: bool = False,
                slots=None, persistent: bool = False):
    """DataLoader over whole micro-batches; workers start via forkserver (safe next to CUDA and threads).

    With `slots` (dflash.train.batch_slots.BatchSlots), workers write context features into them; the
    consumer (DeviceFeeder with the same slots) must release every micro-batch's seq in order.  With
    `persistent`, each `iter()` of the loader reuses its workers (and their dataset) for the keys the
    sampler then gives (RankSampler.restart)."""
    if num_workers < 1:
        raise DataError("num_workers must be >= 1: mask metadata is built in DataLoader worker processes.")
    dataset.slots = slots
    if slots is not None:
        sampler = _Numbered(sampler)
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=None,
        sampler=sampler,
        num_workers=num_workers,
        multiprocessing_context=worker_context(),
        worker_init_fn=functools.partial(_worker_init, trainer_pid=os.getpid()),
        pin_memory=pin_memory,
        prefetch_factor=PREFETCH_FACTOR,
        persistent_workers=persistent,
        # The loader's seeds come from its own generator, not the process's RNG, whose state checkpoints
        # carry: a run then draws the same random numbers however many loaders it starts.
        generator=torch.Generator().manual_seed(0),
    )


__all__ = [
    "LoaderSpec",
    "EpochPlan",
    "PackedDataset",
    "RankSampler",
    "shape_set",
    "fit_shape",
    "eligible_anchors",
    "draw_anchors",
    "block_targets",
    "rollout_reach",
    "target_agreement",
    "plan_epoch",
    "batch_cost",
    "round_up",
    "steps_per_epoch",
    "make_loader",
]
