"""An epoch's plan: which samples share a packed row, which rows form a micro-batch, in what order.

The plan depends on (seed, epoch), the store index and `balance_group` only.  Rows are packed first-fit
among samples of similar length (a window sorted by length), under a context-token and a block-token
budget; `rows_per_batch` rows make a micro-batch.  Processes split the plan round-robin: optimizer step
`s` consumes micro-batches `[s*W*A, (s+1)*W*A)` (W processes, A accumulation steps), so the data position
after any step is a prefix of the plan, stored as "samples consumed in this epoch".  With balance_group =
W*A each step's micro-batches are of similar cost (`_balanced_order`); a resumed run keeps the
checkpoint's balance_group, so its plan, and resumes on any W.

Shapes: the context stream S and block stream Q of a micro-batch are padded to the smallest entry of a
short list of multiples of 128 (`shape_set`), so a compiled drafter sees a handful of shapes in total.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dflash.drafter.masks import TILE
from dflash.errors import DataError


@dataclasses.dataclass(frozen=True)
class LoaderSpec:
    """Everything the workers need to build micro-batches; small and picklable."""

    block_size: int
    num_anchors: int  # per sample per epoch (upper bound)
    token_budget: int  # context tokens per row (S max)
    block_budget: int  # block tokens per row (Q max)
    rows_per_batch: int
    mask_token_id: int
    gamma: float | None = None
    seed: int = 0
    num_shapes: int = 3
    kd: bool = False
    target_labels: bool = False  # labels = the store's top-1 (the target's greedy token), not the data's token
    rollout_labels: bool = False  # and only where the target's greedy walk from the anchor reaches (loader.rollout_reach)
    skip_damaged: bool = False  # a sample failing its checksums is left out of its batch and counted
    balance_group: int = 1  # micro-batches per step to balance (processes x accumulation); 1 = random order
    sliding_window: int | None = None  # the drafter has sliding-window layers: their masks too (masks.py)
    final_hidden: bool = False  # the target's final hidden state at each label's source position (StoreNeeds)

    @property
    def s_shapes(self) -> list[int]:
        return shape_set(self.token_budget, self.num_shapes)

    @property
    def q_shapes(self) -> list[int]:
        return shape_set(self.block_budget, self.num_shapes)

    @property
    def max_blocks(self) -> int:
        return min(self.num_anchors, round_up(self.block_budget) // self.block_size)


_PLAN_WINDOW = 4096  # samples sorted together by length before packing ("length buckets")
_OPEN_ROWS = 8  # rows kept open while packing a window (first-fit among them)


def round_up(n: int, m: int = TILE) -> int:
    return max(m, -(-int(n) // m) * m)


def shape_set(budget: int, count: int = 3) -> list[int]:
    """A short ascending list of multiples of 128 up to round_up(budget): budget, budget/2, budget/4..."""
    return sorted({round_up(budget / 2**i) for i in range(max(1, count))})


def fit_shape(n: int, shapes: list[int]) -> int:
    for s in shapes:
        if n <= s:
            return s
    raise ValueError(f"{n} tokens exceed the largest shape {shapes[-1]}")


@dataclasses.dataclass
class EpochPlan:
    batches: list[list[np.ndarray]]  # micro-batch -> rows -> sample indices (positions in sample_ids)
    samples_before: np.ndarray  # [len(batches) + 1]: samples in micro-batches [0, g)

    def __len__(self) -> int:
        return len(self.batches)

    def batch_at_samples(self, samples: int) -> int:
        """The micro-batch index where a prefix of `samples` samples ends (a resume point)."""
        g = int(np.searchsorted(self.samples_before, samples))
        if g >= len(self.samples_before) or self.samples_before[g] != samples:
            raise DataError(
                f"the saved data position ({samples} samples into the epoch) is not a micro-batch boundary "
                "of this epoch's plan: the store or the data options (token budget, rows per batch, seed, "
                "block size, anchors) changed since the checkpoint; resume with the original settings."
            )
        return g


def batch_cost(batch: list[np.ndarray], ctx: np.ndarray, blk: np.ndarray, spec: LoaderSpec) -> tuple:
    """What a micro-batch costs the GPU, as a sort key: its padded shapes (the drafter's work), then its
    block tokens (the lm_head and loss run on label positions only, up to a quarter of a step)."""
    S = fit_shape(max(int(ctx[r].sum()) for r in batch), spec.s_shapes)
    Q = fit_shape(max(1, max(int(blk[r].sum()) for r in batch)), spec.q_shapes)
    return S, Q, int(sum(blk[r].sum() for r in batch))


def _balanced_order(batches: list, ctx: np.ndarray, blk: np.ndarray, spec: LoaderSpec, rng) -> np.ndarray:
    """The epoch's micro-batch order.  Random when spec.balance_group is 1.  Otherwise each run of
    `balance_group` micro-batches (one optimizer step: processes x accumulation) is made of neighbours by
    cost, in random order inside the step, and the steps come in random order.

    A step lasts as long as its slowest process; with a random order the ranks' block-token counts differ
    widely (a row holds 1 to 4 samples), and every rank waits for the heaviest.  The steps themselves
    stay in random order: grouping whole runs of steps by cost puts steps of similar sample lengths back
    to back, which costs held-out tau.  The leftover
    n % balance_group micro-batches, drawn at random, come last, where the sampler leaves an epoch's tail out."""
    n, G = len(batches), max(1, int(spec.balance_group))
    shuffled = rng.permutation(n)
    if G == 1:
        return shuffled
    keys = [batch_cost(batches[i], ctx, blk, spec) for i in shuffled]  # ties broken by the shuffle
    by_cost = shuffled[sorted(range(n), key=keys.__getitem__)]
    # The leftover micro-batches are drawn at random.  Taking the cheapest ones (an earlier version) left
    # out the same samples in every epoch: the store's shortest, packed into the same cheap last rows
    # each epoch (one length-sorted window up to 4096 samples), so they were never trained at all.
    left = np.zeros(n, dtype=bool)
    if n % G:
        left[rng.choice(n, size=n % G, replace=False)] = True
    tail, body = by_cost[left], by_cost[~left]
    steps = body.reshape(-1, G)[rng.permutation(len(body) // G)]
    steps = np.stack([s[rng.permutation(G)] for s in steps]) if len(steps) else steps
    return np.concatenate([steps.reshape(-1), tail])


def plan_epoch(lengths: np.ndarray, max_blocks: np.ndarray, spec: LoaderSpec, epoch: int) -> EpochPlan:
    """Shuffle, sort windows by length, pack rows under both budgets, group rows, order micro-batches
    (at random, each step's of similar cost: _balanced_order)."""
    rng = np.random.default_rng([int(spec.seed), int(epoch), 0xB0C5])
    S = spec.s_shapes[-1]
    Qb = spec.q_shapes[-1]
    ctx = np.minimum(lengths, S)
    blk = max_blocks * spec.block_size
    order = rng.permutation(np.flatnonzero(max_blocks > 0))
    rows: list[list[int]] = []
    for w0 in range(0, len(order), _PLAN_WINDOW):
        window = order[w0 : w0 + _PLAN_WINDOW]
        window = window[np.argsort(-ctx[window], kind="stable")]
        open_rows: list[list] = []  # [samples, ctx used, blocks used]
        for i in window:
            c, b = int(ctx[i]), int(blk[i])
            for r in open_rows:
                if r[1] + c <= S and r[2] + b <= Qb:
                    r[0].append(int(i))
                    r[1] += c
                    r[2] += b
                    break
            else:
                if len(open_rows) == _OPEN_ROWS:
                    rows.append(open_rows.pop(0)[0])
                open_rows.append([[int(i)], c, b])
        rows.extend(r[0] for r in open_rows)
    R = spec.rows_per_batch
    batches = [[np.asarray(r, dtype=np.int64) for r in rows[i : i + R]] for i in range(0, len(rows), R)]
    batches = [batches[i] for i in _balanced_order(batches, ctx, blk, spec, rng)]
    counts = np.array([sum(len(r) for r in b) for b in batches], dtype=np.int64)
    return EpochPlan(batches, np.concatenate([[0], np.cumsum(counts)]))


__all__ = ["EpochPlan", "batch_cost", "fit_shape", "plan_epoch", "round_up", "shape_set"]
