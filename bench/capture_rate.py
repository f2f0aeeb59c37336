"""Capture against the target's bare forward, and the `dflash precompute` command against both, on real
conversations, for any target directory.

    python bench/capture_rate.py --target DIR --data chats.jsonl [--rows 1000] [--token-budget 16384 65536]
                                 [--max-length 2048] [--layers 3] [--cli] [--out $OUT/capture_rate.json]
    python bench/capture_rate.py --make-random SHAPE OUTDIR --tokenizer DIR [--data chats.jsonl ...]
        # a random-weight target of a shape (smollm2-135m, qwen3-1.7b, qwen3-8b; tiny for a CPU smoke run);
        # with --data, then measured as --target OUTDIR

For each token budget: the rows are rendered with the target's chat template (timed: the CPU's render
rate), cut into precompute's batches (`plan_batches` per window, as `run_shard` does), and run three ways
on the device, each after a warm-up pass over a few batches and timed with a sync at the end:
  forward   the decoder alone (`model.model`), the floor nothing can beat;
  lm_head   the decoder then the lm_head over every real position in chunks (the model's own forward
            without materialising [B, T, V] at once);
  capture   `dflash.target_model.capture.Capture` (hooks on the chosen layers + chunked top-k), what precompute runs.
Rates count real (unpadded) tokens.  With --cli, the command itself runs too, once per budget: `dflash
precompute` (a subprocess, one shard on this device, the same rows, layers, top-k, max length and budget)
into a temporary store; `cli_tok_per_s` is the shard's new tokens over its `loop_s` (rendering + capture +
writes, start-up excluded, from the shard's status), and the result keeps the shard's `writer_s` (the writer's
seconds per stage), `writer_cpu_s`, `write_stall_s` (the capture waiting for the writer) and
`render_workers`.  Ratios: capture and cli over the decoder forward and over the forward with its lm_head.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import QWEN3_8B  # noqa: E402
from dflash.chat import conversation_of, load_rows, render  # noqa: E402
from dflash.precompute.shard import WINDOW, plan_batches  # noqa: E402
from dflash.store.manifest import shard_status  # noqa: E402
from dflash.target_model.capture import Capture, load_target, load_tokenizer  # noqa: E402
from dflash.target_model.files import default_target_layers  # noqa: E402

SHAPES = {
    # SmolLM2-135M-Instruct's config (Llama, tied embeddings)
    "smollm2-135m": dict(arch="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152,
                         tie_word_embeddings=True, rope_theta=100000.0),
    "qwen3-1.7b": dict(arch="qwen3", hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=6144, vocab_size=151936,
                       tie_word_embeddings=True),
    "qwen3-8b": dict(arch="qwen3", tie_word_embeddings=False,
                     **{k: v for k, v in QWEN3_8B.items() if k != "target_layer_ids"}),
    # a CPU smoke run (tests/precompute/test_capture_rate_bench.py); SmolLM2's vocabulary fits its tokenizer
    "tiny": dict(arch="llama", hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=128, vocab_size=49152, tie_word_embeddings=True),
}


def make_random(shape: str, out: Path, tokenizer_dir: Path) -> None:
    """A random-init checkpoint of `shape` with `tokenizer_dir`'s tokenizer (its ids fit every vocab here)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    spec = dict(SHAPES[shape])
    arch = spec.pop("arch")
    cfg_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen3Config, Qwen3ForCausalLM)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    cfg = cfg_cls(**spec, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, max_position_embeddings=8192)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = model_cls(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def batches_of(tok, ds, rows: int, max_length: int, budget: int, where: str):
    t0 = time.perf_counter()
    rendered = [render(tok, conversation_of(ds[r], r, where), max_length).input_ids for r in range(min(rows, len(ds)))]
    render_s = time.perf_counter() - t0
    rendered = [ids for ids in rendered if len(ids) > 1]
    out = []
    for w0 in range(0, len(rendered), WINDOW):
        window = rendered[w0 : w0 + WINDOW]
        for b in plan_batches([len(x) for x in window], budget):
            out.append([window[i] for i in b])
    return out, render_s, sum(len(x) for x in rendered)


def padded(batch, device):
    lengths = [len(x) for x in batch]
    ids = torch.zeros(len(batch), max(lengths), dtype=torch.long)
    for i, x in enumerate(batch):
        ids[i, : len(x)] = torch.tensor(x)
    return ids.to(device), torch.tensor(lengths)


def timed(fn, batches, device, warm: int = 3) -> float:
    for b in batches[:warm]:
        fn(*padded(b, device))
    sync(device)
    inputs = [padded(b, device) for b in batches]
    sync(device)
    t0 = time.perf_counter()
    for ids, lens in inputs:
        fn(ids, lens)
    sync(device)
    return time.perf_counter() - t0


def run_cli(a, budget: int, layer_ids: list[int], device) -> dict:
    """`dflash precompute` on the first `a.rows` rows into a temporary store: its loop rate and writer stages."""
    if a.cli_dir:  # a fresh machine's scratch folder may not exist yet
        Path(a.cli_dir).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="capture_rate_cli_", dir=a.cli_dir))
    cmd = [sys.executable, "-m", "dflash.cli", "precompute", "--target", a.target, "--data", a.data,
           "--out", str(tmp / "store"), "--shards", "1", "--gpus", "0" if device.type == "cuda" else "cpu",
           "--target-layers", ",".join(map(str, layer_ids)), "--max-length", str(a.max_length),
           "--topk", str(a.topk), "--token-budget", str(budget), "--max-samples", str(a.rows)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    try:
        t0 = time.perf_counter()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if done.returncode:
            raise RuntimeError(f"dflash precompute failed ({done.returncode}):\n{done.stderr[-4000:]}")
        st = shard_status(tmp / "store", 0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    keep = ("loop_s", "new_tokens", "new_samples", "render_workers", "write_stall_s", "writer_s", "writer_cpu_s",
            "first_batch_s", "steady_tok_per_s", "render_wait_s", "capture_s", "submit_s", "gc_s")
    return {"cli_tok_per_s": round(st["new_tokens"] / max(st["loop_s"], 1e-9)), "cli_wall_s": round(wall, 2),
            **{f"cli_{k}": st.get(k) for k in keep}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--make-random", nargs=2, metavar=("SHAPE", "OUTDIR"))
    ap.add_argument("--tokenizer")
    ap.add_argument("--target")
    ap.add_argument("--data")
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--token-budget", type=int, nargs="+", default=[16384])
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--cli", action="store_true", help="time `dflash precompute` on the same rows too")
    ap.add_argument("--cli-dir", default=None, help="where --cli's temporary store goes (default: the temp dir)")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.make_random:
        make_random(a.make_random[0], Path(a.make_random[1]), Path(a.tokenizer))
        if not a.data:
            return
        a.target = a.make_random[1]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = load_tokenizer(a.target)
    ds = load_rows(a.data, "train", None, check=False)
    model = load_target(a.target, torch.bfloat16 if device.type == "cuda" else torch.float32, device)
    n_layers = model.config.get_text_config().num_hidden_layers
    layer_ids = default_target_layers(n_layers, a.layers)
    capture = Capture(model, layer_ids, a.topk)
    head = model.get_output_embeddings()
    decoder = model.get_decoder()

    @torch.inference_mode()
    def forward(ids, lens):
        decoder(input_ids=ids, use_cache=False)

    @torch.inference_mode()
    def lm_head(ids, lens):
        h = decoder(input_ids=ids, use_cache=False).last_hidden_state
        flat = torch.cat([h[i, :n] for i, n in enumerate(lens.tolist())])
        for s in range(0, flat.shape[0], 4096):
            head(flat[s : s + 4096])

    res = {"target": a.target, "params": sum(p.numel() for p in model.parameters()), "layer_ids": layer_ids,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "budgets": {}}
    for budget in a.token_budget:
        batches, render_s, tokens = batches_of(tok, ds, a.rows, a.max_length, budget, a.data)
        r = {"batches": len(batches), "tokens": tokens, "render_tok_per_s": round(tokens / render_s)}
        for name, fn in (("forward", forward), ("lm_head", lm_head), ("capture", capture)):
            r[f"{name}_tok_per_s"] = round(tokens / timed(fn, batches, device))
        if a.cli:
            r.update(run_cli(a, budget, layer_ids, device))
        for name in ("capture", "cli") if a.cli else ("capture",):
            for ref in ("forward", "lm_head"):
                r[f"{name}_over_{ref}"] = round(r[f"{name}_tok_per_s"] / r[f"{ref}_tok_per_s"], 3)
        res["budgets"][budget] = r
        print(json.dumps({budget: r}), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
