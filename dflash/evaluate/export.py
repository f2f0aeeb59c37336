"""`dflash export`: a training checkpoint as a DFlashDraftModel directory (the format vLLM and SGLang load).

    OUT/config.json         Qwen3 fields + architectures ["DFlashDraftModel"], block_size, num_target_layers,
                            dflash_config {mask_token_id, target_layer_ids}   (DrafterConfig.to_hf_dict)
    OUT/model.safetensors   the drafter only: layers.N.*, fc.weight, hidden_norm.weight, norm.weight
                            (a --context-scale rms checkpoint's buffer folded into fc.weight, not written)

The target's embedding and lm_head are not part of the drafter: the serving engine shares the target's.
The directory is assembled next to OUT and renamed into place, so OUT is either the old export, the new
one, or absent, never half-written.  `--check` reloads OUT the way a consumer would (config.json ->
DrafterConfig, strict load of the safetensors) and compares its logits with the checkpoint's model.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import torch

from dflash.config import ExportConfig, flat_options
from dflash.drafter import FAMILIES, family_of
from dflash.errors import ConfigError, DFlashError

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}
_HF_DTYPE = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
# Wrappers that may prefix parameter names in a state dict (DDP, torch.compile).
_PREFIXES = ("module.", "_orig_mod.")


def _strip(key: str) -> str:
    changed = True
    while changed:
        changed = False
        for p in _PREFIXES:
            if key.startswith(p):
                key, changed = key[len(p) :], True
    return key.replace("._orig_mod.", ".")


def drafter_state(state: dict[str, torch.Tensor], cfg, where, fold: bool = True) -> dict[str, torch.Tensor]:
    """Exactly the exported key set (model.state_dict_keys), or a DFlashError naming what is off.  A
    --context-scale rms state has its context_scale buffer folded into fc.weight (`fold`; else dropped):
    the plain DFlash drafter computing the same function."""
    from dflash.drafter import export_keys
    from dflash.drafter.dflash.model import CONTEXT_SCALE, fold_context_scale

    state = {_strip(k): v for k, v in state.items()}
    state = fold_context_scale(state) if fold else {k: v for k, v in state.items() if k != CONTEXT_SCALE}
    want = export_keys(cfg)  # the family's own modules too
    missing = [k for k in want if k not in state]
    if missing:
        raise DFlashError(
            f"{where} lacks drafter weight(s) {missing[:5]}{' ...' if len(missing) > 5 else ''} for a "
            f"{cfg.num_hidden_layers}-layer drafter; it is not a complete dflash checkpoint."
        )
    return {k: state[k] for k in want}


def load_training_drafter(run_or_checkpoint) -> tuple[torch.nn.Module, Path, dict]:
    """(DFlashDrafter in fp32 eval mode, checkpoint dir, train_config dict) from a run or checkpoint dir."""
    from safetensors.torch import load_file

    from dflash.drafter import build_drafter, config_from_hf_dict
    from dflash.drafter.dflash.model import CONTEXT_SCALE
    from dflash.train.checkpoint import check_safetensors, resolve_checkpoint

    src = Path(run_or_checkpoint)
    if not src.exists():
        raise DFlashError(f"{src} does not exist; pass a `dflash train` run directory or one of its checkpoints.")
    ckpt = resolve_checkpoint(src)
    cfg_path = ckpt / "config.json"
    try:
        check_safetensors(ckpt / "model.safetensors")
    except DFlashError as e:
        raise DFlashError(f"checkpoint {ckpt} cannot be used: {e} Pass an earlier checkpoint of the run "
                          f"({ckpt.parent}/step-*), or resume training to write a new one.") from None
    try:
        cfg = config_from_hf_dict(json.loads(cfg_path.read_text()))
        state = load_file(str(ckpt / "model.safetensors"))
    except Exception as e:  # noqa: BLE001 - OSError, ValueError, KeyError, TypeError, SafetensorError
        raise DFlashError(f"checkpoint {ckpt} cannot be read ({type(e).__name__}: {e}); it is incomplete or not "
                          "a dflash checkpoint.") from None
    # A --context-scale rms checkpoint: the drafter keeps its buffer (eval applies it, export folds it).
    state = {_strip(k): v for k, v in state.items()}
    scaled = CONTEXT_SCALE in state
    drafter = build_drafter(cfg, context_scale=scaled)
    weights = drafter_state(state, cfg, ckpt, fold=False)
    if scaled:
        weights[CONTEXT_SCALE] = state[CONTEXT_SCALE]
    missing, unexpected = drafter.load_state_dict(weights, strict=False)  # the rotary buffer is not saved
    if [k for k in missing if not k.startswith("rotary_emb.")] or unexpected:
        raise DFlashError(f"checkpoint {ckpt} does not load as its drafter (missing {missing}, unexpected {unexpected}).")
    train_config = {}
    if (ckpt / "train_config.json").is_file():
        train_config = json.loads((ckpt / "train_config.json").read_text())
    return drafter.float().eval(), ckpt, train_config


def load_export(out_dir, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Reload an export as a consumer would: config.json -> DrafterConfig, strict weight load."""
    from safetensors.torch import load_file

    from dflash.drafter import build_drafter, config_from_hf_dict
    from dflash.train.checkpoint import check_safetensors

    out_dir = Path(out_dir)
    check_safetensors(out_dir / "model.safetensors")
    d = json.loads((out_dir / "config.json").read_text())
    cfg = config_from_hf_dict(d)  # of the family its `architectures` names
    eagle = d.get("eagle_aux_hidden_state_layer_ids")
    if eagle is not None and list(eagle) != [i + 1 for i in cfg.target_layer_ids]:
        raise DFlashError(f"export {out_dir}: eagle_aux_hidden_state_layer_ids {eagle} is not target_layer_ids + 1 "
                          f"({cfg.target_layer_ids}); vLLM would feed the drafter other layers than it was trained on.")
    drafter = build_drafter(cfg)
    missing, unexpected = drafter.load_state_dict(load_file(str(out_dir / "model.safetensors")), strict=False)
    missing = [k for k in missing if not k.startswith("rotary_emb.")]
    if missing or unexpected:
        raise DFlashError(f"export {out_dir} does not load as a DFlash drafter (missing {missing}, "
                          f"unexpected {unexpected}).")
    return drafter.to(dtype).eval()


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move `tmp` to `out`, swapping out an earlier export whole."""
    if not out.exists():
        os.replace(tmp, out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def _check_out(out: Path, source: Path) -> None:
    if out.resolve() == source.resolve() or source.resolve() in out.resolve().parents:
        raise ConfigError(f"export directory {out} is inside the source {source}; choose a directory outside it.")
    if out.exists():
        text = (out / "config.json").read_text() if (out / "config.json").is_file() else ""
        is_export = any(a in text for f in FAMILIES.values() for a in f.architectures)
        if not out.is_dir() or (any(out.iterdir()) and not is_export):
            raise ConfigError(
                f"{out} exists and is not an earlier dflash export; pass a new directory (an earlier export "
                "is replaced whole, anything else is left alone)."
            )


def _is_local_path(v) -> bool:
    return isinstance(v, str) and (v.startswith(("/", "~", "\\")) or (len(v) > 2 and v[1] == ":" and v[2] in "/\\"))


def _without_local_paths(d: dict) -> dict:
    """Top-level entries holding a path of this machine (transformers' `_name_or_path`, carried-over
    extras) are left out of an export that is meant to be copied elsewhere."""
    drop = [k for k, v in d.items() if k in ("_name_or_path", "name_or_path") or _is_local_path(v)]
    return {k: v for k, v in d.items() if k not in drop}


def engine_config(cfg) -> dict:
    """The export's config.json: DrafterConfig.to_hf_dict() plus what the engines read first.

    vLLM takes the target's capture points from `eagle_aux_hidden_state_layer_ids` before
    `dflash_config.target_layer_ids` (vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py): the stream
    entering layer i + 1 for DFlash id i.  A drafter whose ids the engines could not serve is refused."""
    from dflash.target_model.files import engine_layer_problem

    problem = engine_layer_problem(cfg.target_layer_ids, cfg.num_target_layers)
    if problem:
        raise ConfigError(f"cannot export this drafter for vLLM / SGLang: {problem}")
    hf = _without_local_paths(cfg.to_hf_dict())
    hf["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in cfg.target_layer_ids]
    return hf


def export_drafter(drafter, out, dtype: torch.dtype = torch.bfloat16, metadata: dict | None = None) -> Path:
    """Write `drafter` as a DFlashDraftModel directory at `out`, atomically."""
    from dflash.train.checkpoint import save_safetensors

    out = Path(out)
    cfg = drafter.config
    hf = engine_config(cfg)
    metadata = {k: v for k, v in (metadata or {}).items() if not _is_local_path(v)}
    hf["architectures"] = cfg.to_hf_dict()["architectures"]  # the family's
    hf["model_type"] = "qwen3"
    hf["dtype"] = _HF_DTYPE[dtype]
    hf["torch_dtype"] = _HF_DTYPE[dtype]  # what transformers < 4.56 (and engines built on it) read
    state = drafter_state(drafter.state_dict(), cfg, "the drafter")
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in state.items()}

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_safetensors(tensors, tmp / "model.safetensors", {"format": "pt", **(metadata or {})})
        (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
        for f in ("model.safetensors", "config.json"):
            os.chmod(tmp / f, 0o644)  # safetensors writes 0600; an export is read by serving engines
        _replace_dir(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e):
            raise DFlashError(f"no space left on the device while writing the export {out} (in {tmp}): free "
                              f"space on {out.parent} and rerun `dflash export`.") from e
        raise
    return out


def _random_batch(cfg, lm_head: torch.Tensor, seed: int = 0):
    """One packed row: random context features and two blocks of random tokens on random anchors."""
    from dflash.drafter import masks

    g = torch.Generator().manual_seed(seed)
    B, S = cfg.block_size, 128
    anchors = [5, 40]
    ctx = torch.randn(1, S, cfg.num_features * cfg.hidden_size, generator=g)
    Q = 128 * ((2 * B + 127) // 128)
    block_pos = torch.zeros(1, Q, dtype=torch.long)
    for j, a in enumerate(anchors):
        block_pos[0, j * B : (j + 1) * B] = torch.arange(a, a + B)
    meta = masks.mask_metadata([0], [S], [0] * len(anchors), anchors, B, S, Q,
                               sliding_window=cfg.sliding_window if cfg.has_sliding else None)
    embeds = torch.randn(1, Q, cfg.hidden_size, generator=g)
    return ctx, embeds, torch.arange(S).view(1, -1), block_pos, masks.to_dense_mask(meta)


@torch.no_grad()
def check_export(out_dir, reference, dtype: torch.dtype, lm_head: torch.Tensor | None = None) -> dict:
    """Logits of the reloaded export vs `reference` (the training model with weights rounded to `dtype`,
    so only naming, layout and config can differ: the match must be exact up to fp32 noise)."""
    exported = load_export(out_dir, torch.float32)
    # The reference keeps a --context-scale buffer, the export has it folded into fc: this compares the fold too.
    ref = type(reference)(reference.config, context_scale=reference.context_scale is not None)
    ref.load_state_dict({k: v.to(dtype).float() for k, v in reference.state_dict().items()}, strict=False)
    ref.eval()
    cfg = reference.config
    if lm_head is None:
        lm_head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    lm_head = lm_head.float()
    batch = _random_batch(cfg, lm_head)
    a = exported(*batch) @ lm_head.t()
    b = ref(*batch) @ lm_head.t()
    diff = float((a - b).abs().max())
    scale = float(b.abs().max())
    fields = _without_local_paths(exported.config.to_hf_dict()) == _without_local_paths(ref.config.to_hf_dict())
    own_diff, same = family_of(cfg).export_check(exported, ref, batch, lm_head)  # its own outputs, same blocks
    diff, fields = max(diff, own_diff), fields and same
    ok = diff <= 1e-4 * max(1.0, scale) and fields
    return {"ok": ok, "max_abs_logit_diff": diff, "max_abs_logit": scale, "config_round_trip": fields,
            "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean())}


def _lm_head_of(train_config: dict):
    from dflash.target_model.files import load_embed_and_head

    target = flat_options(train_config.get("train") or train_config).get("target")  # nested, or flat (older runs)
    if target and Path(target).is_dir():
        try:
            return load_embed_and_head(target)[1]
        except DFlashError:
            return None
    return None


def run_export(cfg: ExportConfig) -> dict:
    """`dflash export RUN_OR_CHECKPOINT OUT [--check]`."""
    if not cfg.source or not cfg.out:
        raise ConfigError("usage: dflash export RUN_OR_CHECKPOINT OUT [--check]")
    if cfg.dtype not in DTYPES:
        raise ConfigError(f"export dtype {cfg.dtype!r} is not one of bf16, fp16, fp32.")
    dtype = DTYPES[cfg.dtype]
    source, out = Path(cfg.source), Path(cfg.out)
    drafter, ckpt, train_config = load_training_drafter(source)
    _check_out(out, ckpt)
    export_drafter(drafter, out, dtype, metadata={"source": ckpt.name})  # no path of this machine
    result = {"out": str(out), "checkpoint": str(ckpt), "dtype": cfg.dtype}
    print(f"exported {ckpt} -> {out} ({cfg.dtype})")
    if cfg.check:
        report = check_export(out, drafter, dtype, _lm_head_of(train_config))
        result["check"] = report
        print(f"check: max |logit diff| {report['max_abs_logit_diff']:.3g} (max |logit| {report['max_abs_logit']:.3g}), "
              f"config round trip {'ok' if report['config_round_trip'] else 'DIFFERS'}")
        if not report["ok"]:
            raise DFlashError(
                f"export check failed for {out}: the reloaded export's logits differ from the checkpoint's model by "
                f"up to {report['max_abs_logit_diff']:.3g} (config round trip: {report['config_round_trip']}). "
                "This is a bug in dflash's export; please report it with the checkpoint's config.json."
            )
    return result


__all__ = ["run_export", "export_drafter", "load_export", "load_training_drafter", "check_export", "drafter_state"]
