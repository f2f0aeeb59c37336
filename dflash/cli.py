"""The `dflash` command line: parse flags, merge them over params.yaml, call one function per command.

Only this module knows about the command line.  Heavy imports (torch, transformers) happen inside the
commands so that `dflash --help` is instant.
"""

from __future__ import annotations

import functools
import sys
import traceback
import typing

import click

from dflash.config import (
    EvalConfig,
    ExportConfig,
    GenerateConfig,
    PrecomputeConfig,
    TrainConfig,
    build_config,
    choices_of,
    default_config_path,
    options_of,
    show_default,
)
from dflash.errors import DFlashError, out_of_memory, out_of_memory_message


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
                if e.worker_traceback:
                    click.echo(e.worker_traceback, err=True)
            _fail(str(e))
        except KeyboardInterrupt:
            _fail("interrupted; rerun the same command to continue where it stopped.", code=130)
        except Exception as e:
            if debug or not out_of_memory(e):
                raise
            _fail(out_of_memory_message(ctx.info_name, e) + " --debug shows where it ran out.")

    return wrapper


def _config_path(config: str | None):
    return config if config is not None else default_config_path()


config_option = click.option(
    "--config",
    type=click.Path(dir_okay=False),
    default=None,
    help="params.yaml to read option defaults from (default: ./params.yaml when present). Flags win.",
)


def _click_type(tp):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    base = args[0] if typing.get_origin(tp) is not None and args and typing.get_origin(tp) not in (list, tuple) else tp
    return {int: int, float: float}.get(base, str)  # lists and tuples: comma-separated strings


def options_from(cls, skip: tuple[str, ...] = ()):
    """One click option per option of the config dataclass `cls` (for `dflash train`, every field of every
    section, flat: --lr, not --optim-lr), its help taken from the field: written once in dflash/config/.
    Defaults stay None here, so that build_config knows which flags were given."""

    def decorate(fn):
        for name, o in reversed(list(options_of(cls).items())):
            if name in skip:
                continue
            flag = "--" + name.replace("_", "-")
            default = show_default(o.field)
            text = o.field.metadata["help"] + (f" [default: {default}]" if default != "-" else "")
            if o.type is bool:
                fn = click.option(f"{flag}/--no-{flag[2:]}", name, default=None, help=text)(fn)
            elif choices_of(o.type):
                fn = click.option(flag, name, type=click.Choice(choices_of(o.type)), help=text)(fn)
            else:
                fn = click.option(flag, name, type=_click_type(o.type), help=text)(fn)
        return fn

    return decorate


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--debug", is_flag=True, help="Show tracebacks for user errors too.")
@click.version_option(package_name="dflash")
def main(debug: bool) -> None:
    """Train DFlash speculative-decoding drafters.

    \b
    Optionally, the target first writes the responses it will be served with:
      dflash generate --target DIR --data chats.jsonl --out regenerated.jsonl
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
@options_from(GenerateConfig)
@user_errors
def generate(config, **flags):
    """Rewrite a dataset's assistant turns with the target's own responses (in-process or via a server).

    The rows are written back in the format they were read, as JSON lines.  Rerunning the same command
    continues an interrupted run; finished rows are never generated again.
    """
    from dflash.generate.run import run_generate

    run_generate(build_config(GenerateConfig, _config_path(config), flags, explicit=config is not None))


@main.command()
@config_option
@options_from(PrecomputeConfig)
@user_errors
def precompute(config, **flags):
    """Run the target over a dataset and write hidden states, top-k and loss masks to a store.

    Rerunning the same command continues an interrupted run; a finished store is left as it is.
    """
    from dflash.precompute.run import run_precompute

    cfg = build_config(PrecomputeConfig, _config_path(config), flags, explicit=config is not None)
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
@options_from(TrainConfig)
@user_errors
def train(config, **flags):
    """Train a DFlash drafter from a store, one process per GPU."""
    from dflash.train.launch import launch_train

    cfg = build_config(TrainConfig, _config_path(config), flags, explicit=config is not None)
    launch_train(cfg)


@main.command(name="eval")
@config_option
@options_from(EvalConfig)
@user_errors
def eval_(config, **flags):
    """Measure acceptance length tau offline (store) or online (speculative decoding, lossless check)."""
    from dflash.evaluate.run import run_eval

    cfg = build_config(EvalConfig, _config_path(config), flags, explicit=config is not None)
    if not cfg.store and not cfg.prompts and not cfg.bench:
        raise click.UsageError("give --store HELDOUT_STORE (offline) or --prompts PATH and/or --bench SETS "
                               "--target DIR (online).")
    click.echo(eval_summary(run_eval(cfg)))


def eval_summary(result: dict) -> str:
    """One line per kind of tau the eval measured, each named: with both a store and prompts, the top-level
    `tau` of the JSON is the offline one, which is not the online tau a user asked --prompts for."""
    lines = []
    if "offline" in result:
        off = result["offline"]
        lines.append(f"offline tau = {off['tau']:.3f} over {off['num_samples']} held-out samples ({off['store']})")
        if "walk" in off:  # the engine's greedy walk over the target's own replies: online tau's stand-in
            w = off["walk"]
            lines.append(f"walk tau = {w['tau']:.3f} over {w['num_blocks']} steps of {w['num_samples']} replies "
                         f"(their first {w['max_new_tokens']} tokens)"
                         + (f"; {w['num_too_long']} longer than a row left out" if w.get("num_too_long") else ""))
    if "online" in result:
        on = result["online"]
        lines.append(f"online tau = {on['tau']:.3f} over {on['num_prompts']} prompts, speed-up "
                     f"{on['speedup']:.2f}x, lossless = {result['lossless']}"
                     + (f" ({on['prompts_left_out']} longer than the target's context left out)"
                        if on.get("prompts_left_out") else ""))
    if result.get("bench"):
        from dflash.evaluate.bench_report import bench_table

        lines.append(bench_table(result["bench"]))
    return "\n".join(lines)


@main.command()
@click.argument("source", type=click.Path())
@click.argument("out", type=click.Path())
@options_from(ExportConfig, skip=("source", "out"))
@user_errors
def export(source, out, **flags):
    """Write a run or checkpoint as a DFlashDraftModel directory that vLLM and SGLang load."""
    from dflash.evaluate.export import run_export

    run_export(build_config(ExportConfig, None, {"source": source, "out": out, **flags}))


if __name__ == "__main__":
    main()
