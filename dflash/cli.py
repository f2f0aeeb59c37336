"""The `dflash` command line: parse flags, merge them over params.yaml, call one function per command.

Only this module knows about the command line.  Heavy imports (torch, transformers) happen inside the
commands so that `dflash --help` is instant.
"""

from __future__ import annotations

import functools
import sys
import traceback

import click

from dflash.config import (
    EvalConfig,
    ExportConfig,
    PrecomputeConfig,
    TrainConfig,
    build_config,
    default_config_path,
)
from dflash.errors import DFlashError


def _fail(message: str, code: int = 1) -> None:
    # Not wrapped: paths and sample ids in the message must stay copyable.
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def user_errors(fn):
    """Turn a DFlashError into a one-paragraph message and exit status 1; `--debug` keeps tracebacks."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        ctx = click.get_current_context()
        debug = bool(ctx.find_root().params.get("debug"))
        try:
            return fn(*args, **kwargs)
        except DFlashError as e:
            if debug:
                traceback.print_exc()
            _fail(str(e))
        except KeyboardInterrupt:
            _fail("interrupted; rerun the same command to continue where it stopped.", code=130)

    return wrapper


def _config_path(config: str | None):
    return config if config is not None else default_config_path()


config_option = click.option(
    "--config",
    type=click.Path(dir_okay=False),
    default=None,
    help="params.yaml to read option defaults from (default: ./params.yaml when present). Flags win.",
)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--debug", is_flag=True, help="Show tracebacks for user errors too.")
@click.version_option(package_name="dflash")
def main(debug: bool) -> None:
    """Train DFlash speculative-decoding drafters.

    \b
    Stage one writes the target's hidden states to a sharded store:
      dflash precompute --target DIR --data chats.jsonl --out STORE --shards 5
    Stage two trains the drafter from it, one process per GPU:
      dflash train --store STORE --target DIR --out RUN --gpus 5,6,7
    Then measure and ship it:
      dflash eval --run RUN --store HELDOUT_STORE
      dflash export RUN OUT --check
    """


@main.command()
@config_option
@click.option("--target", help="Local directory of the target (any AutoModelForCausalLM).")
@click.option("--data", help="Conversations: json/jsonl/parquet/arrow file or a saved datasets directory.")
@click.option("--out", help="Store directory to write (resumed when it exists).")
@click.option("--shards", type=int, help="Number of shards = processes (one per GPU). Default 1.")
@click.option("--gpus", help="'0,1,2,3,4' (one per shard), 'cpu', or 'auto' (CUDA when present).")
@click.option("--target-layers", help="Comma-separated 0-based target layers to capture, e.g. 1,9,17,25,33.")
@click.option("--num-draft-layers", type=int, help="Drafter depth used to pick default target layers.")
@click.option("--max-length", type=int, help="Truncate samples longer than this many tokens.")
@click.option("--topk", type=int, help="Target top-k log-probs stored per position (0 = off). Default 8.")
@click.option("--hidden-dtype", type=click.Choice(["bf16", "fp8"]), help="Stored hidden-state format.")
@click.option("--token-budget", type=int, help="Tokens per target forward batch.")
@click.option("--max-samples", type=int, help="Use only the first N dataset rows.")
@click.option("--split", help="Split to read from a saved DatasetDict (default train).")
@click.option("--compile", type=click.Choice(["auto", "on", "off"]),
              help="torch.compile the top-k reduction (auto: on for CUDA).")
@click.option("--writer", type=click.Choice(["process", "thread"]),
              help="Where the store is written: a process per shard (default; keeps the GIL free for the GPU) or a thread.")
@click.option("--trust-remote-code", is_flag=True, default=None, help="Allow the target's own code.")
@click.option("--overwrite", is_flag=True, default=None, help="Delete an existing store and start over.")
@click.option("--restart-changed", is_flag=True, default=None,
              help="Start over when the existing store was made from other inputs (pipelines); else resume.")
@user_errors
def precompute(config, **flags):
    """Run the target over a dataset and write hidden states, top-k and loss masks to a store.

    Rerunning the same command continues an interrupted run; a finished store is left as it is.
    """
    from dflash.precompute.run import run_precompute

    cfg = build_config(PrecomputeConfig, _config_path(config), flags)
    run_precompute(cfg)


@main.command()
@click.argument("store", type=click.Path())
@click.option("--quick", is_flag=True, help="Check manifest and indexes only, not data checksums.")
@user_errors
def verify(store, quick):
    """Check a store: manifest, indexes against arrays, and per-sample checksums."""
    from dflash.store import verify_store

    report = verify_store(store, checksums=not quick)
    click.echo(report.summary())
    if not report.ok:
        _fail(report.problem_message())


@main.command()
@config_option
@click.option("--store", help="Store written by `dflash precompute`.")
@click.option("--target", help="Target directory (frozen embedding and lm_head are read from it).")
@click.option("--out", help="Run directory (metrics, checkpoints, TensorBoard events).")
@click.option("--gpus", help="'5,6,7' = one process per GPU; 'cpu:N' = N CPU processes (gloo).")
@click.option("--block-size", type=int, help="Tokens per drafted block (default 16).")
@click.option("--num-layers", type=int, help="Drafter layers.")
@click.option("--mask-token-id", type=int, help="Token id used for masked block positions.")
@click.option("--steps", type=int, help="Total optimizer steps (overrides --epochs).")
@click.option("--epochs", type=float, help="Epochs over the store.")
@click.option("--lr", type=float, help="Peak learning rate.")
@click.option("--token-budget", type=int, help="Context tokens per packed row.")
@click.option("--num-anchors", type=int, help="Anchors (blocks) per sample per epoch.")
@click.option("--grad-accum", type=int, help="Micro-batches per optimizer step.")
@click.option("--rows-per-batch", type=int,
              help="Packed rows per micro-batch (default 1; 4 on an H200 at 8B shape: +7 MFU points, see docs/BENCHMARKS.md).")
@click.option("--kd-weight", type=float, help="Weight of the KD term against the stored top-k.")
@click.option("--num-workers", type=int, help="DataLoader worker processes per training process.")
@click.option("--parallel", type=click.Choice(["ddp", "fsdp"]), help="Data parallelism (default ddp).")
@click.option("--balance-steps/--no-balance-steps", default=None,
              help="Order each epoch's micro-batches so that the processes of a step get ones of similar cost "
                   "(default), or at random.")
@click.option("--batch-slots/--no-batch-slots", default=None,
              help="Workers hand over context features in reusable shared, page-locked slots (default) or in a "
                   "fresh shared tensor per micro-batch that the DataLoader pins.")
@click.option("--ddp-overlap/--no-ddp-overlap", default=None,
              help="DDP: all-reduce gradients during the backward (default) or after it.")
@click.option("--compile", type=click.Choice(["auto", "on", "off"]), help="torch.compile the drafter.")
@click.option("--loss-kernel", type=click.Choice(["compiled", "triton"]),
              help="The lm_head chunks' softmax and gradient: dflash's Triton kernel (default; CUDA and KD off, "
                   "elsewhere it falls back to the compiled path) or torch.compile'd.")
@click.option("--gc-every", type=int,
              help="Collect Python garbage every N steps instead of at random ones (default 50; 0 = Python's automatic GC).")
@click.option("--profile-steps", type=int,
              help="Profile this many steps in every process (kernel table + Chrome trace in <out>/profile/).")
@click.option("--profile-start", type=int, help="Steps of this run before profiling starts (default 5).")
@click.option("--save-every", type=int, help="Checkpoint every N steps (and at the end).")
@click.option("--eval-every", type=int, help="Offline tau on --eval-store every N steps.")
@click.option("--eval-store", help="Held-out store for --eval-every.")
@click.option("--seed", type=int, help="Seed for anchors, data order and init.")
@click.option("--resume", is_flag=True, default=None, help="Continue from the newest checkpoint in --out.")
@click.option("--overwrite", is_flag=True, default=None, help="Delete an existing run directory first.")
@user_errors
def train(config, **flags):
    """Train a DFlash drafter from a store, one process per GPU."""
    from dflash.train.launch import launch_train

    cfg = build_config(TrainConfig, _config_path(config), flags)
    launch_train(cfg)


@main.command(name="eval")
@config_option
@click.option("--run", help="Run directory or checkpoint directory.")
@click.option("--store", help="Held-out store: offline acceptance length.")
@click.option("--prompts", help="Held-out conversations: online speculative decoding against the target.")
@click.option("--target", help="Target directory (online mode).")
@click.option("--out", help="Output JSON (default RUN/eval.json).")
@click.option("--max-samples", type=int, help="Evaluate at most N samples or prompts.")
@click.option("--max-new-tokens", type=int, help="Tokens to generate per prompt (online).")
@click.option("--device", help="'auto', 'cpu' or 'cuda:0'.")
@click.option("--plots/--no-plots", default=None, help="Write PNG plots beside the JSON.")
@user_errors
def eval_(config, **flags):
    """Measure acceptance length tau offline (store) or online (speculative decoding, lossless check)."""
    from dflash.evaluate.run import run_eval

    cfg = build_config(EvalConfig, _config_path(config), flags)
    if not cfg.store and not cfg.prompts:
        raise click.UsageError("give --store HELDOUT_STORE (offline) or --prompts PATH --target DIR (online).")
    result = run_eval(cfg)
    click.echo(f"tau = {result['tau']:.3f}" + (f", lossless = {result['lossless']}" if "lossless" in result else ""))


@main.command()
@click.argument("source", type=click.Path())
@click.argument("out", type=click.Path())
@click.option("--check", is_flag=True, help="Reload the export and compare its logits with the training model.")
@user_errors
def export(source, out, check):
    """Write a run or checkpoint as a DFlashDraftModel directory that vLLM and SGLang load."""
    from dflash.evaluate.export import run_export

    run_export(ExportConfig(source=source, out=out, check=check))


if __name__ == "__main__":
    main()
