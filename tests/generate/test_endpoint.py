"""A real `transformers serve` on 127.0.0.1 serving the tiny target, used as --endpoint: the same
responses as in-process greedy generation; unknown model names and dead servers refused up front."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import httpx
import pytest

from dflash.config import GenerateConfig
from dflash.errors import ConfigError, GenerateError
from dflash.generate.journal import work_dir
from dflash.generate.run import run_generate
from helpers import make_conversations_jsonl


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory, long_llama):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("openai")
    exe = shutil.which("transformers") or pytest.skip("no `transformers` command")
    port = free_port()
    log = open(tmp_path_factory.mktemp("serve") / "serve.log", "w+")
    p = subprocess.Popen([exe, "serve", str(long_llama), "--host", "127.0.0.1", "--port", str(port),
                          "--device", "cpu", "--dtype", "float32"], stdout=log, stderr=subprocess.STDOUT,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            if p.poll() is not None:
                log.seek(0)
                pytest.fail(f"transformers serve exited:\n{log.read()[-3000:]}")
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        yield url, str(long_llama)
    finally:
        p.terminate()
        p.wait(timeout=30)
        log.close()


def cfg(**kw) -> GenerateConfig:
    base = dict(gpus="cpu", max_new_tokens=12, batch_size=1, concurrency=4, turns="all")
    base.update({k: str(v) for k, v in kw.items() if v is not None} | {k: v for k, v in kw.items()
                                                                          if isinstance(v, (int, float))})
    return GenerateConfig(**base)


def require_listed_model(url: str) -> None:
    """These tests need a server that names the model it serves at /v1/models. `transformers serve` of
    releases before ~5.2x answers there with an error or lists nothing, and dflash then asks for --model;
    CI installs the newest release, which lists its model."""
    r = httpx.get(url + "/v1/models", timeout=30)
    try:
        listed = r.json().get("data") if r.status_code == 200 else None
    except ValueError:
        listed = None
    if not listed:
        pytest.skip(f"this `transformers serve` lists no models at /v1/models (HTTP {r.status_code})")


@pytest.mark.slow
def test_transformers_serve_gives_the_in_process_responses(tmp_path, server, long_llama):
    url, model = server
    require_listed_model(url)
    data = make_conversations_jsonl(tmp_path / "chats.jsonl", 6, max_words=6)
    local, remote = tmp_path / "local.jsonl", tmp_path / "remote.jsonl"
    run_generate(cfg(target=long_llama, data=data, out=local))
    s = run_generate(cfg(endpoint=url, data=data, out=remote))  # the server's only model is taken
    assert remote.read_bytes() == local.read_bytes()
    assert s["rows"] == 6 and s["cut"] > 0 and s["tokens"] > 0  # it never stops early: every turn is cut


@pytest.mark.slow
def test_unknown_model_and_dead_server_are_refused_before_anything_is_written(tmp_path, server):
    url, model = server
    require_listed_model(url)
    data = make_conversations_jsonl(tmp_path / "chats.jsonl", 2)
    out = tmp_path / "out.jsonl"
    with pytest.raises(ConfigError, match=r"--model 'nope' is not served by .*lists '"):
        run_generate(cfg(endpoint=url, model="nope", data=data, out=out))
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(GenerateError, match=f"cannot reach the OpenAI-compatible server at {dead}/v1"):
        run_generate(cfg(endpoint=dead, model=model, data=data, out=out))
    assert not out.exists() and not work_dir(out).exists()
    # the command line: one paragraph, no traceback, exit status 1
    r = subprocess.run([sys.executable, "-m", "dflash.cli", "generate", "--endpoint", dead, "--model", "m",
                        "--data", str(data), "--out", str(out)], capture_output=True, text=True,
                       cwd=tmp_path)  # no ./params.yaml
    assert r.returncode == 1 and r.stderr.startswith("error: cannot reach") and "Traceback" not in r.stderr
    assert not out.exists() and not work_dir(out).exists()
