"""Reading a target directory without building the model: identity, tokenizer hash, frozen tensors.

Training needs only the target's embedding table and lm_head; reading them tensor by tensor with
safetensors avoids materialising a 8-70B model in a training process.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from dflash.errors import TargetError

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "added_tokens.json",
)

EMBED_KEYS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "embed_tokens.weight", "transformer.wte.weight")
HEAD_KEYS = ("lm_head.weight",)


def _target_dir(target_dir: str | Path) -> Path:
    p = Path(target_dir)
    if not p.is_dir():
        raise TargetError(
            f"target directory {p} does not exist; pass a local directory holding a transformers "
            "checkpoint (config.json, *.safetensors, tokenizer files) with --target."
        )
    if not (p / "config.json").is_file():
        raise TargetError(f"target directory {p} has no config.json; it is not a transformers checkpoint.")
    return p


def _read_config_json(target_dir: Path) -> dict:
    try:
        return json.loads((target_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TargetError(f"{target_dir / 'config.json'} cannot be read ({e}); fix or replace the file.") from None


def _text_config(cfg: dict) -> dict:
    # Multimodal wrappers keep the language model's shape under text_config.
    return cfg.get("text_config") or cfg


def target_config(target_dir: str | Path, trust_remote_code: bool = False):
    from transformers import AutoConfig

    p = _target_dir(target_dir)
    try:
        return AutoConfig.from_pretrained(str(p), trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises many types for a bad config
        raise TargetError(f"cannot load the config of target {p}: {e}") from None


def context_length(target_dir: str | Path) -> int | None:
    """The target's context in positions (its text config's max_position_embeddings), or None if unnamed."""
    n = _text_config(_read_config_json(_target_dir(target_dir))).get("max_position_embeddings")
    return int(n) if n else None


def target_identity(target_dir: str | Path, weights: bool = True) -> dict:
    """What a store records about its target, and what training compares against (`weights=False`: without
    the weights fingerprint, for callers that never compare it)."""
    p = _target_dir(target_dir)
    raw = _read_config_json(p)
    cfg = _text_config(raw)
    # The hash covers the architecture-defining fields, not bookkeeping that transformers rewrites
    # (e.g. transformers_version, dtype spelling), so re-saving a checkpoint keeps its identity.
    keys = sorted(k for k in cfg if k not in ("transformers_version", "torch_dtype", "dtype", "_name_or_path"))
    config_hash = hashlib.sha256(json.dumps({k: cfg[k] for k in keys}, sort_keys=True, default=str).encode()).hexdigest()
    arch = raw.get("architectures") or []
    return {
        "path": str(p.resolve()),
        "config_hash": config_hash,
        "architecture": arch[0] if arch else None,
        "model_type": raw.get("model_type"),
        "hidden_size": cfg.get("hidden_size"),
        "num_hidden_layers": cfg.get("num_hidden_layers"),
        "vocab_size": cfg.get("vocab_size"),
        "weights_fingerprint": weights_fingerprint(p) if weights else None,
    }


def weights_fingerprint(target_dir: str | Path) -> str | None:
    """sha256 over every tensor's name, dtype, shape and three sampled slices (first, middle, last row).

    Two checkpoints of one architecture (a base model and its fine-tune, two training runs) share config
    and tokenizer but give other hidden states; a store made from one feeds the other's drafter features
    it never sees when served.  Sampling reads ~3 rows per tensor, not the weights, and is independent of
    how the checkpoint is split into files.  None for a checkpoint without safetensors (nothing to read).
    """
    from safetensors import safe_open

    p = Path(target_dir)
    files = sorted(p.glob("*.safetensors"))
    if not files:
        return None
    digests = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    sl = fh.get_slice(name)
                    shape = list(sl.get_shape())
                    d = hashlib.sha256(f"{name}|{sl.get_dtype()}|{shape}".encode())
                    for part in _sampled_rows(fh, name, sl, shape):
                        d.update(part.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
                    digests[name] = d.hexdigest()
        except Exception as e:  # safetensors raises several types for a bad file
            raise TargetError(f"target weights {f} cannot be read ({e}); re-download or re-save the checkpoint.") from None
    h = hashlib.sha256()
    for name in sorted(digests):  # file order and split do not matter
        h.update(f"{name}={digests[name]};".encode())
    return h.hexdigest()


def _sampled_rows(fh, name: str, sl, shape: list[int]) -> list[torch.Tensor]:
    if not shape or 0 in shape:
        return [fh.get_tensor(name).reshape(-1)]
    n = shape[0]
    w = min(n, 256) if len(shape) == 1 else 1  # a 1-D tensor's "row" is a window of its values
    return [sl[i : i + w] for i in sorted({0, max(0, n // 2 - w // 2), n - w})]


def tokenizer_hash(target_dir: str | Path) -> str:
    """sha256 over the tokenizer files and chat template: two stores agree on tokens iff this agrees."""
    p = _target_dir(target_dir)
    h = hashlib.sha256()
    found = False
    for name in TOKENIZER_FILES:
        f = p / name
        if f.is_file():
            found = True
            h.update(name.encode())
            h.update(f.read_bytes())
    if not found:
        raise TargetError(f"target directory {p} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...).")
    return h.hexdigest()


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """As many layers as the drafter has, evenly spaced from 1 to num_target_layers - 3 (docs/DESIGN.md §2).

    Shallow targets (the embedded default has 4 layers) cannot hold that many distinct layers in
    [1, L-3]; then [0, L-2] is used.  Never the last layer: the engines feed the drafter the stream
    entering layer i+1, which does not exist for i = L-1.
    """
    n, L = num_draft_layers, num_target_layers
    if n == 1:
        return [L // 2]
    lo, hi = 1, L - 3
    if hi - lo + 1 < n:
        lo, hi = 0, L - 2
    if hi - lo + 1 < n:
        return list(range(min(n, L)))
    step = (hi - lo) / (n - 1)
    return [int(round(lo + i * step)) for i in range(n)]


def _safetensors_index(p: Path) -> dict[str, str]:
    """tensor name -> file name, for single-file and sharded checkpoints."""
    idx = p / "model.safetensors.index.json"
    if idx.is_file():
        return json.loads(idx.read_text())["weight_map"]
    single = p / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {k: "model.safetensors" for k in f.keys()}
    raise TargetError(
        f"target directory {p} has no model.safetensors or model.safetensors.index.json; "
        "convert the checkpoint to safetensors (dflash never unpickles .bin weights)."
    )


def load_embed_and_head(target_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding [V, H] and lm_head [V, H], read alone from safetensors."""
    from safetensors import safe_open

    p = _target_dir(target_dir)
    weight_map = _safetensors_index(p)
    cfg = _read_config_json(p)

    def get(keys: tuple[str, ...]) -> torch.Tensor | None:
        for k in keys:
            if k in weight_map:
                with safe_open(str(p / weight_map[k]), framework="pt") as f:
                    return f.get_tensor(k)
        # Some wrappers prefix the language model (e.g. "model.language_model.embed_tokens.weight").
        for k, fname in weight_map.items():
            if any(k.endswith(s) for s in keys):
                with safe_open(str(p / fname), framework="pt") as f:
                    return f.get_tensor(k)
        return None

    embed = get(EMBED_KEYS)
    if embed is None:
        raise TargetError(f"target {p}: no embedding tensor ({' or '.join(EMBED_KEYS)}) in its safetensors.")
    head = get(HEAD_KEYS)
    if head is None:
        if cfg.get("tie_word_embeddings", _text_config(cfg).get("tie_word_embeddings", False)):
            head = embed
        else:
            raise TargetError(f"target {p}: no lm_head.weight in its safetensors and embeddings are not tied.")
    return embed, head


NORM_KEYS = ("model.norm.weight", "model.language_model.norm.weight", "norm.weight")


def load_final_norm(target_dir: str | Path) -> torch.Tensor:
    """The target's final norm weight [H], read alone from safetensors (a drafter family that recomputes
    the target's distribution from the pre-norm last hidden state needs it)."""
    from safetensors import safe_open

    p = _target_dir(target_dir)
    weight_map = _safetensors_index(p)
    for k in NORM_KEYS:
        if k in weight_map:
            with safe_open(str(p / weight_map[k]), framework="pt") as f:
                return f.get_tensor(k)
    raise TargetError(f"target {p}: no final norm tensor ({' or '.join(NORM_KEYS)}) in its safetensors; "
                      "a drafter that recomputes the target's distribution from its last hidden state needs it "
                      "(--tv-source final_hidden); train with --tv-source topk instead.")


def engine_layer_problem(target_layer_ids: list[int], num_target_layers: int) -> str | None:
    """Why vLLM / SGLang could not serve a drafter reading these target layers, with what to pass
    instead; None when they can (docs/DESIGN.md §2).  The engines capture the residual stream entering
    layer i + 1 for DFlash id i and concatenate the captured layers in ascending order."""
    ids, L = [int(i) for i in target_layer_ids], int(num_target_layers)
    if L - 1 in ids:
        usable = sorted({i for i in ids if i != L - 1})
        alt = default_target_layers(L, len(ids))
        if L - 1 in alt or len(set(alt)) != len(ids):
            alt = usable or [max(L - 2, 0)]
        return (f"target_layer_ids {ids} include the target's last layer {L - 1} (of 0..{L - 1}): vLLM and SGLang "
                f"feed a DFlash drafter the residual stream entering layer i + 1, and no layer follows the last one, "
                f"so this drafter could not be served. Precompute the store with --target-layers "
                f"{','.join(map(str, alt))} (every id below {L - 1}) and train on that store.")
    if ids != sorted(ids):
        return (f"target_layer_ids {ids} are not in ascending order: vLLM and SGLang concatenate the captured "
                f"layers in ascending order, so fc would get its inputs permuted. Precompute the store with "
                f"--target-layers {','.join(map(str, sorted(ids)))} and train on that store.")
    return None
