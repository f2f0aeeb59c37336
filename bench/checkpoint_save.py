"""What one checkpoint costs the training loop: a drafter of a real target's shape with its AdamW state.

    BENCH_SHAPE=smollm2-135m python bench/checkpoint_save.py [--arch dflash2] [--layers 3] [--reps 3]

Builds the drafter (fp32 weights, as training keeps them), takes one AdamW step on random gradients so
the optimizer holds its two moments, then times, `--reps` times: the state gathered to host memory (what
`TrainStep.state_dict` does) and `checkpoint.save_checkpoint` (safetensors weights, the training state,
fsyncs, the atomic rename), into $BENCH_WORK; then what the training loop waits for with the writer
thread (`host_snapshot` + `CheckpointWriter.save`, the trainer's path), and how long the write takes
behind it.  Prints each phase's best and median seconds and the bytes.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time

import torch

import common  # noqa: F401  (puts the repo root on sys.path)
from common import dims, work_dir
from dflash.drafter import DrafterConfig, build_drafter, with_arch
from dflash.train import checkpoint as ckpt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="dflash2", choices=["dflash", "dflash2"])
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    d = dims(False)
    ids = d["target_layer_ids"][: a.layers]
    cfg = DrafterConfig(hidden_size=d["hidden_size"], num_hidden_layers=a.layers,
                        num_attention_heads=d["num_attention_heads"], num_key_value_heads=d["num_key_value_heads"],
                        head_dim=d["head_dim"], intermediate_size=d["intermediate_size"], vocab_size=d["vocab_size"],
                        num_target_layers=d["num_hidden_layers"], target_layer_ids=ids, mask_token_id=0, block_size=16)
    model = build_drafter(with_arch(cfg, a.arch) if a.arch != "dflash" else cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    out = work_dir() / "checkpoint_bench"
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    gather, write, nbytes = [], [], 0
    for i in range(a.reps):
        t0 = time.perf_counter()
        model_state = get_model_state_dict(model, options=opts)
        train_state = {"optimizer": get_optimizer_state_dict(model, opt, options=opts), "step": i}
        t1 = time.perf_counter()
        final = ckpt.save_checkpoint(out, i + 1, model_state, {"architectures": ["bench"]}, train_state, {}, keep=1)
        t2 = time.perf_counter()
        gather.append(t1 - t0)
        write.append(t2 - t1)
        nbytes = sum(f.stat().st_size for f in final.iterdir())
    writer, blocked, behind = ckpt.CheckpointWriter(), [], []
    for i in range(a.reps):
        t0 = time.perf_counter()
        state = ckpt.host_snapshot({"model": get_model_state_dict(model, options=opts),
                                    "optimizer": get_optimizer_state_dict(model, opt, options=opts), "step": i},
                                   torch.device("cpu"))
        writer.save(out, 100 + i, state.pop("model"), {"architectures": ["bench"]}, state, {}, keep=1)
        t1 = time.perf_counter()
        writer.wait()
        blocked.append(t1 - t0)
        behind.append(time.perf_counter() - t1)
    shutil.rmtree(out, ignore_errors=True)
    params = sum(p.numel() for p in model.parameters())
    med = statistics.median
    print(f"{a.arch}, {a.layers} layers, {params / 1e6:.1f}M parameters, checkpoint {nbytes / 1e6:.0f} MB:\n"
          f"  in the loop: gather best {min(gather):.3f} s median {med(gather):.3f} s, write best {min(write):.3f} s "
          f"median {med(write):.3f} s\n"
          f"  with the writer thread: the loop waits best {min(blocked):.3f} s median {med(blocked):.3f} s "
          f"(gather + copy), the write behind it best {min(behind):.3f} s median {med(behind):.3f} s")


if __name__ == "__main__":
    main()
