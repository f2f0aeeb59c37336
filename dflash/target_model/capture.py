"""The target model: loading it, capturing chosen layers' hidden states, and its top-k next-token log-probs.

Hidden states come from forward hooks on the decoder layers rather than `output_hidden_states=True`, which
would keep every layer's activations alive; with top-k off the forward stops right after the last layer
needed.  Top-k runs lm_head over a chunk of positions at a time, so the full-vocabulary logits of a whole
batch (rows x length x 150k floats) never exist at once.

Capture never waits for the GPU: real positions are found from `lengths` on the host, not by boolean
indexing on the device (a host sync each, after which the GPU idles until the main thread has queued
more work).  The top-k reads the logits in the model's dtype and takes the fp32 log-normaliser in one
fused pass (compiled on GPU) instead of materialising fp32 log-softmax over 152k entries per position.
Together they bring capture closer to the bare forward's speed (benchmarks/precompute-qwen3-8b-h200-2026-11-30.md).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from dflash.errors import TargetError

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is bf16 on GPU and fp32 on CPU (CPU bf16 matmuls are slow and only tests run there)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise TargetError(f"unknown target dtype {name!r}; use auto, bf16 or fp32.")
    return DTYPES[name]


def _check_dir(target_dir) -> Path:
    p = Path(target_dir)
    if not p.is_dir() or not (p / "config.json").is_file():
        raise TargetError(
            f"target {p} is not a local transformers checkpoint (no {'directory' if not p.is_dir() else 'config.json'}); "
            "pass a directory holding config.json, the safetensors weights and the tokenizer with --target."
        )
    return p


def load_tokenizer(target_dir, trust_remote_code: bool = False):
    """The target's fast tokenizer; it must have a chat template (loss masks come from it)."""
    from transformers import AutoTokenizer

    p = _check_dir(target_dir)
    try:
        tok = AutoTokenizer.from_pretrained(str(p), trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError... for broken tokenizers
        raise TargetError(f"cannot load the tokenizer of target {p} ({type(e).__name__}: {e}).") from None
    if not getattr(tok, "chat_template", None):
        raise TargetError(
            f"the tokenizer of target {p} has no chat template, so assistant turns cannot be told apart; "
            "use an instruct/chat checkpoint or add a chat_template.jinja to that directory."
        )
    if not getattr(tok, "is_fast", False):
        raise TargetError(
            f"the tokenizer of target {p} is not a fast tokenizer (no tokenizer.json); loss masks need its "
            "character offsets. Convert it with transformers and save it to the directory."
        )
    return tok


def no_hub_kernels() -> dict:
    """from_pretrained's switch that keeps the `kernels` library from swapping layers for kernels fetched
    from the Hugging Face Hub, which transformers 5.25 does by default when `kernels` is installed: that is
    code from the network, which dflash runs only when asked; other numerics than the target's own; and on
    the meta device it refuses to load at all."""
    import transformers

    return {"use_kernels": False} if int(transformers.__version__.split(".")[0]) >= 5 else {}


def check_config_matches_weights(target_dir, trust_remote_code: bool = False) -> None:
    """Load the checkpoint onto the meta device (the model's skeleton, no tensor data) through transformers'
    own key mapping, so that a config.json that disagrees with the weights fails before a store exists:
    tensors the config asks for that the files lack would be random-initialised, and tensors of another
    shape would be re-initialised.  Unexpected tensors are fine (a VL checkpoint's vision tower, MTP heads)."""
    import transformers
    from transformers import AutoModelForCausalLM

    p = _check_dir(target_dir)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        _, info = AutoModelForCausalLM.from_pretrained(str(p), device_map="meta", output_loading_info=True,
                                                       ignore_mismatched_sizes=True, trust_remote_code=trust_remote_code,
                                                       **no_hub_kernels())
    except Exception as e:
        raise TargetError(
            f"cannot load target {p} as a causal LM ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
            "check that the directory holds a complete checkpoint (pass --trust-remote-code only if it needs its "
            "own code)."
        ) from None
    finally:
        transformers.logging.set_verbosity(verbosity)
        transformers.logging.enable_progress_bar()
    missing, mismatched = sorted(info.get("missing_keys") or []), list(info.get("mismatched_keys") or [])
    if not missing and not mismatched:
        return
    said = []
    if missing:
        said.append(f"{len(missing)} tensor(s) the config asks for are not in the weights (e.g. {missing[0]})")
    if mismatched:
        name, in_file, in_config = mismatched[0][:3]
        said.append(f"{len(mismatched)} tensor(s) have another shape in the weights (e.g. {name}: "
                    f"{list(in_file)} in the files, {list(in_config)} by the config)")
    raise TargetError(
        f"target {p}: config.json disagrees with the checkpoint's weights: {'; '.join(said)}. Loading it would "
        "random-initialise those tensors. The config was edited or belongs to another checkpoint: restore the "
        "checkpoint's own config.json (or re-download the checkpoint), then rerun."
    )


def load_target(target_dir, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False):
    """An `AutoModelForCausalLM` in eval mode on `device`, without gradients."""
    from transformers import AutoModelForCausalLM

    p = _check_dir(target_dir)
    # With accelerate installed, weights load straight onto the GPU instead of through host memory
    # (which N shard processes of a large target would otherwise each fill).
    kw = {"device_map": {"": str(device)}} if device.type != "cpu" and importlib.util.find_spec("accelerate") else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(str(p), dtype=dtype, trust_remote_code=trust_remote_code,
                                                     **kw, **no_hub_kernels())
        model.to(device)
    except Exception as e:
        raise TargetError(
            f"cannot load target {p} as a causal LM ({type(e).__name__}: {e}); check that the directory "
            "holds a complete checkpoint (pass --trust-remote-code only if it needs its own code)."
        ) from None
    model.eval().requires_grad_(False)
    return model


def linear_attention_note(model) -> str | None:
    """A start-up line for a hybrid target (Gated DeltaNet layers, Qwen3-Next / Qwen3.5): whether the
    flash-linear-attention kernels are there; without them transformers runs those layers in plain torch."""
    types = list(getattr(model.config.get_text_config(), "layer_types", None) or [])
    n = sum(t == "linear_attention" for t in types)
    if not n:
        return None
    what = f"the target has {n} Gated DeltaNet (linear-attention) layers of {len(types)}"
    if importlib.util.find_spec("fla") is not None:
        return f"{what}; flash-linear-attention is installed (transformers uses its kernels on a GPU)."
    return (f"{what}, and flash-linear-attention is not installed: transformers runs them with its torch fallback, "
            "several times slower on a GPU. Install the kernels with `pip install 'dflash[fla]'`.")


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder's layer list (`model.model.layers` for Llama/Qwen3, found generically otherwise)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, torch.nn.ModuleList):
        return layers
    n = model.config.get_text_config().num_hidden_layers
    for mod in model.modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) == n:
            return mod
    raise TargetError(f"cannot find the decoder layers of {type(model).__name__}; this architecture is unsupported.")


def check_layers(layer_ids: list[int], num_layers: int, target_dir) -> list[int]:
    """Layer ids must be distinct and in 0..num_layers-1 (the output of layer i = hidden_states[i + 1])."""
    if not layer_ids:
        raise TargetError("no target layers to capture; pass --target-layers, e.g. 1,9,17.")
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad:
        raise TargetError(
            f"target layer id(s) {', '.join(map(str, bad))} out of range: target {target_dir} has {num_layers} "
            f"layers (valid ids 0..{num_layers - 1}); fix --target-layers."
        )
    if len(set(layer_ids)) != len(layer_ids):
        raise TargetError(f"--target-layers {layer_ids} repeats a layer; list each layer once.")
    return list(layer_ids)


class _Stop(Exception):
    """Raised by the last needed hook to end a forward early."""


class Capture:
    """Runs the target on a right-padded batch and returns what the store keeps, all in `model`'s device.

    Right padding needs no attention mask: under causal attention a real token never sees the pads after
    it, so the fast causal kernel runs and the real positions are exactly those of an unpadded forward.
    """

    def __init__(self, model, layer_ids: list[int], topk: int = 8, lm_head_chunk: int = 4096, compile: str = "auto",
                 final_hidden: bool = False):
        if compile not in ("auto", "on", "off"):
            raise TargetError(f"compile must be auto, on or off, not {compile!r}.")
        self.model = model
        self.layers = decoder_layers(model)
        self.layer_ids = check_layers(layer_ids, len(self.layers), getattr(model, "name_or_path", "?"))
        self.topk = topk
        self.final_hidden = final_hidden
        self.lm_head_chunk = lm_head_chunk
        self.decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.final_norm = getattr(self.decoder, "norm", None)
        cfg = model.config.get_text_config()
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        self.logits_scaling = getattr(cfg, "logits_scaling", None)  # Granite divides logits by it
        device = next(model.parameters()).device
        self._topk = topk_logprobs
        if compile == "on" or (compile == "auto" and device.type == "cuda"):
            # dynamic: the last chunk of a batch is shorter, and must not recompile
            self._topk = torch.compile(topk_logprobs, dynamic=True)

    def warm_up(self, token_id: int = 0, length: int = 64) -> None:
        """One small forward (and top-k) before the first real batch: the top-k compiles and the device's
        libraries initialise here, while a shard's render workers and writer process still start."""
        device = next(self.model.parameters()).device
        ids = torch.full((1, length), int(token_id), dtype=torch.long, device=device)
        self(ids, torch.tensor([length - 1]))
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, lengths: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """input_ids [B, T] -> hidden [B, T, L*H]; with top-k also topk_ids [B, T, K] int64 and
        topk_logprobs [B, T, K] float32 (zeros at padded positions); with `final_hidden` also final_hidden
        [B, T, H], the last decoder layer's output before the final norm.  `lengths` [B] marks the real
        positions; pass it on the CPU (on a GPU it costs a host sync)."""
        captured: dict[int, torch.Tensor] = {}
        last_layer = len(self.layers) - 1
        last_needed = last_layer if self.final_hidden else max(self.layer_ids)
        hooked = set(self.layer_ids) | ({last_layer} if self.final_hidden else set())

        def hook_for(i):
            def hook(_module, _args, output):
                h = output[0] if isinstance(output, (tuple, list)) else output
                if i == last_layer and self.final_hidden:
                    # pre-norm: a trainer recomputes the full distribution as lm_head(final_norm(h))
                    captured[-1] = h
                if i in self.layer_ids:
                    if i == last_layer and self.final_norm is not None:
                        h = self.final_norm(h)  # transformers' hidden_states[-1] is after the final norm
                    captured[i] = h
                if self.topk == 0 and i == last_needed:
                    raise _Stop

            return hook

        handles = [self.layers[i].register_forward_hook(hook_for(i)) for i in hooked]
        try:
            out = self.decoder(input_ids=input_ids, use_cache=False)
        except _Stop:
            out = None
        finally:
            for h in handles:
                h.remove()
        result = {"hidden": torch.cat([captured[i] for i in self.layer_ids], dim=-1)}
        if self.final_hidden:
            result["final_hidden"] = captured[-1]
        if self.topk > 0:
            ids, logprobs = self.topk_of(out.last_hidden_state, lengths)
            result["topk_ids"], result["topk_logprobs"] = ids, logprobs
        return result

    def topk_of(self, last_hidden: torch.Tensor, lengths) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, H = last_hidden.shape
        device = last_hidden.device
        flat = last_hidden.reshape(B * T, H)
        rows = real_positions(B, T, lengths)  # host tensor, or None when every position is real
        if rows is not None:
            rows = rows.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else rows.to(device)
            flat = flat.index_select(0, rows)
        head = self.model.get_output_embeddings()
        out_ids, out_lp = [], []
        for s in range(0, flat.shape[0], self.lm_head_chunk):
            ix, lp = self._topk(head(flat[s : s + self.lm_head_chunk]), self.topk, self.logits_scaling, self.softcap)
            out_ids.append(ix)
            out_lp.append(lp)
        ids = torch.cat(out_ids) if out_ids else torch.zeros(0, self.topk, dtype=torch.int64, device=device)
        logprobs = torch.cat(out_lp) if out_lp else torch.zeros(0, self.topk, dtype=torch.float32, device=device)
        if rows is not None:  # back to [B*T, K] with zeros at the padded positions
            ids = torch.zeros(B * T, self.topk, dtype=torch.int64, device=device).index_copy_(0, rows, ids)
            logprobs = torch.zeros(B * T, self.topk, dtype=torch.float32, device=device).index_copy_(0, rows, logprobs)
        return ids.view(B, T, self.topk), logprobs.view(B, T, self.topk)


def real_positions(B: int, T: int, lengths) -> torch.Tensor | None:
    """Flat indices (b * T + t, t < lengths[b]) of a right-padded [B, T] batch's real positions, made on
    the host; None when no position is padding."""
    if lengths is None:
        return None
    lengths = torch.as_tensor(lengths).cpu().long().clamp(0, T)
    if bool((lengths == T).all()):
        return None
    valid = torch.arange(T)[None, :] < lengths[:, None]
    return valid.reshape(-1).nonzero().squeeze(1)


def topk_logprobs(logits: torch.Tensor, k: int, scaling: float | None = None, softcap: float | None = None):
    """[N, V] logits in the model's dtype -> (top-k ids [N, k] int64, their log-probs [N, k] float32).

    Scaling by a positive constant and tanh soft-capping keep the order of the logits, so the top-k is
    taken on the raw logits (half the bytes of fp32) and only the k winners and the log-normaliser are
    computed in fp32; compiled, the upcast fuses into the logsumexp reduction (one read of the logits)."""

    def transform(x):
        x = x.float()
        if scaling:
            x = x / scaling
        if softcap:
            x = torch.tanh(x / softcap) * softcap
        return x

    lse = torch.logsumexp(transform(logits), dim=-1, keepdim=True)
    vals, ids = logits.topk(k, dim=-1)
    return ids, transform(vals) - lse
