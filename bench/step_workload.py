"""The workload of bench/train_step.py: micro-batches made by the real loader code over a synthetic store,
the create_block_mask baseline (bench only: the package never calls it), and the FLOP count of a step."""

from __future__ import annotations

import time

import numpy as np
import torch

import common  # noqa: F401  (puts the repo root on sys.path)
from dflash.drafter import DrafterConfig, masks
from dflash.train import loader as L
from dflash.train.batch import MicroBatch

TILE = masks.TILE


class SyntheticStore:
    """What PackedDataset needs of a Store (sample_ids, lengths, num_supervised, read), with random
    hidden states sliced from one pool so that building many samples costs no random generation."""

    def __init__(self, lengths, width: int, vocab: int, seed: int = 0, prompt_frac: float = 0.15):
        rng = np.random.default_rng(seed)
        self._lengths = np.asarray(lengths, dtype=np.int64)
        pool = int(self._lengths.max()) * 2
        g = torch.Generator().manual_seed(seed)
        self.pool = torch.randn(pool, width, generator=g).to(torch.bfloat16)
        self.offsets = [int(rng.integers(0, pool - n + 1)) for n in self._lengths]
        self.ids = [torch.from_numpy(rng.integers(0, vocab - 1, int(n))) for n in self._lengths]
        self.masks = []
        for n in self._lengths:
            m = torch.ones(int(n), dtype=torch.bool)
            m[: int(prompt_frac * n)] = False  # the prompt is not supervised
            self.masks.append(m)

    def sample_ids(self):
        return list(range(len(self._lengths)))

    def lengths(self):
        return self._lengths

    def num_supervised(self):
        return np.array([int(m.sum()) for m in self.masks], dtype=np.int64)

    def read(self, sid, fields=None):
        o, n = self.offsets[sid], int(self._lengths[sid])
        return {"input_ids": self.ids[sid], "loss_mask": self.masks[sid], "hidden": self.pool[o : o + n]}


def split_lengths(rng, total: int, k: int) -> list[int]:
    """k sample lengths (each within +-25% of total/k) that fill `total` context tokens exactly."""
    base = total // k
    lens = [int(base + rng.integers(-base // 4, base // 4 + 1)) for _ in range(k - 1)]
    lens.append(total - sum(lens))
    return lens


def build_batches(n_batches: int, R: int, S: int, Q: int, k: int, B: int, width: int, vocab: int, seed: int,
                  sliding_window: int | None = None):
    """n_batches micro-batches of R rows, each row k samples filling S context tokens and Q block tokens,
    built by loader.PackedDataset.build; also the per-row mask_metadata calls (for timing them)."""
    rng = np.random.default_rng(seed)
    row_lengths = [split_lengths(rng, S, k) for _ in range(n_batches * R)]
    store = SyntheticStore([n for row in row_lengths for n in row], width, vocab, seed)
    spec = L.LoaderSpec(block_size=B, num_anchors=Q // (B * k), token_budget=S, block_budget=Q, rows_per_batch=R,
                        mask_token_id=vocab - 1, num_shapes=1, seed=seed, sliding_window=sliding_window)
    ds = L.PackedDataset(store, spec)
    calls, orig = [], masks.mask_metadata

    def recording(*a, **kw):
        calls.append((a, kw))
        return orig(*a, **kw)

    batches, build_s = [], []
    masks.mask_metadata = recording  # loader calls masks.mask_metadata through the module
    try:
        for i in range(n_batches):
            rows = [np.arange(k) + (i * R + r) * k for r in range(R)]
            t = time.perf_counter()
            batches.append(ds.build(epoch=i, rows=rows, g=i))
            build_s.append(time.perf_counter() - t)
    finally:
        masks.mask_metadata = orig
    return batches, calls, build_s


def pin(b):
    if isinstance(b, MicroBatch):
        return b.pin_memory()
    if isinstance(b, torch.Tensor):
        return b.pin_memory()
    if isinstance(b, dict):
        return {k: pin(v) for k, v in b.items()}
    return b


def to_device(b, device):
    nb = torch.device(device).type == "cuda"
    if isinstance(b, MicroBatch):
        return b.to(device, non_blocking=nb)
    if isinstance(b, torch.Tensor):
        return b.to(device, non_blocking=nb)
    if isinstance(b, dict):
        return {k: to_device(v, device) for k, v in b.items()}
    return b


def create_block_mask_baseline(meta):
    """The baseline: the same mask_mod, tile classes computed by create_block_mask (bench only)."""
    from torch.nn.attention.flex_attention import create_block_mask

    R, Q = meta["q_sample"].shape
    KV = meta["kv_sample"].shape[-1]
    return create_block_mask(masks.make_mask_mod(meta), B=R, H=None, Q_LEN=Q, KV_LEN=KV,
                             device=meta["q_sample"].device, BLOCK_SIZE=TILE)


def live_tiles(meta, layer_types: list[str] | None = None) -> float:
    """Tiles one layer computes, averaged over the drafter's layers (a sliding layer skips the tiles
    outside its window: the `swa_` tiles of masks.mask_metadata)."""
    full = int(meta["kv_num_blocks"].sum()) + int(meta["full_kv_num_blocks"].sum())
    if not layer_types or masks.SLIDING_ATTENTION not in layer_types:
        return full
    swa = int(meta["swa_kv_num_blocks"].sum()) + int(meta["swa_full_kv_num_blocks"].sum())
    n_swa = layer_types.count(masks.SLIDING_ATTENTION)
    return (full * (len(layer_types) - n_swa) + swa * n_swa) / len(layer_types)


def step_flops(c: DrafterConfig, R: int, S: int, Q: int, n_labels: int, tiles: int) -> dict:
    """FLOPs of one training step, by component (see 'formulas' in the result)."""
    H, I, V = c.hidden_size, c.intermediate_size, c.vocab_size  # noqa: E741  (I: the intermediate size, as in the formulas)
    nh, nkv, hd, Ly = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.num_hidden_layers
    fc = 2 * R * S * (c.num_features * H) * H
    per_layer = (2 * R * Q * H * nh * hd            # q_proj (block tokens)
                 + 2 * 2 * R * (S + Q) * H * nkv * hd  # k_proj, v_proj (context + block tokens)
                 + 2 * R * Q * nh * hd * H          # o_proj
                 + 3 * 2 * R * Q * H * I)           # gate, up, down
    fwd_matmul = fc + Ly * per_layer
    attn_fwd = Ly * tiles * TILE * TILE * hd * nh * 2 * 2
    attn = attn_fwd * (1 + 2.5)
    lm_head = 2 * (2 * n_labels * H * V)  # forward + input gradient; the head is frozen
    total = 3 * fwd_matmul + attn + lm_head
    extra = dflash2_flops(c, R, Q, n_labels)
    total += sum(extra.values())
    return {"total": total, **extra, "drafter_matmul_fwd": fwd_matmul, "drafter_matmul_train": 3 * fwd_matmul,
            "fc_fwd": fc, "attention_train": attn, "attention_fwd": attn_fwd, "lm_head_train": lm_head,
            "live_tiles": tiles, "n_labels": n_labels,
            # fc has no input gradient (the context features are data): 3x overcounts it by one fc forward
            "total_strict": total - fc}


def dflash2_flops(c, R: int, Q: int, n_labels: int) -> dict:
    """A DFlash2 drafter's extra FLOPs (none for DFlash): its convolutions' kernel projections (trained like
    the layers: 3x) and the selector (hidden projection and K scores per label; fwd + weight gradient, its
    inputs detached).  Its top-K candidates come from the loss's own lm_head pass: no extra matmul."""
    if not hasattr(c, "selector_rank"):
        return {}
    taps, G, r, K, H = c.conv_kernel_size, c.hidden_size // c.conv_group_size, c.selector_rank, c.selector_top_k, c.hidden_size
    conv = c.num_hidden_layers * 2 * 2 * R * Q * H * (2 * taps * G)
    return {"dflash2_conv_train": 3 * conv,
            "dflash2_selector_train": 2 * (2 * n_labels * H * r + 2 * n_labels * K * r)}


FLOP_FORMULAS = {
    "total": "3 * drafter_matmul_fwd + attention_train + lm_head_train",
    "drafter_matmul_fwd": "fc 2*R*S*(L*H)*H + layers * (q 2*R*Q*H*nh*hd + k,v 2*2*R*(S+Q)*H*nkv*hd "
                          "+ o 2*R*Q*nh*hd*H + mlp 3*2*R*Q*H*I)",
    "attention_train": "layers * live_tiles * 128*128*hd*nh*2*2 (QK^T and PV) * (1 fwd + 2.5 bwd); live tiles = "
                       "sum of kv_num_blocks + full_kv_num_blocks over rows (partial + full 128x128 tiles)",
    "lm_head_train": "2 * 2*n_labels*H*V (forward + input gradient, no weight gradient: frozen); n_labels = "
                     "block positions with a label (lm_head is applied to those only)",
    "total_strict": "total minus one fc forward (fc needs no input gradient)",
    "mfu": "total / step time / 989e12",
    "dflash2_conv_train": "--arch dflash2: 3 * layers * 2 convs * 2*R*Q*H*(2*taps*H/conv_group_size) (kernel_projection)",
    "dflash2_selector_train": "--arch dflash2: 2 * (2*n_labels*H*rank + 2*n_labels*top_k*rank) (fwd + weight grad)",
}
