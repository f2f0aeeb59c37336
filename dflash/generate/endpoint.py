"""Generation through an OpenAI-compatible chat completions server: vLLM, SGLang, `transformers serve`.

Requests run concurrently (--concurrency in flight) on one asyncio loop.  A request that times out or
meets a connection error, 408, 429 or a 5xx is retried with exponential backoff; when the retries are
spent the run stops with a GenerateError (the rows finished so far are kept: rerun to continue).
Another 4xx refuses that row alone, which is then left out of the output and counted by reason.

Reasoning: servers with a reasoning parser return the thinking apart, in `reasoning_content` (vLLM,
SGLang, transformers) or `reasoning`; it is put back in front of the answer as `<think>\\n...\\n</think>\\n\\n`,
the form Qwen3-style templates split again when they render the turn (docs/DESIGN.md §10).
"""

from __future__ import annotations

import asyncio
import os
import random

import httpx

from dflash.errors import ConfigError, GenerateError
from dflash.generate.local import Request, Response, template_kwargs

RETRY_STATUS = {408, 429, 500, 502, 503, 504}


def base_url(endpoint: str) -> str:
    """`http://host:port` or `.../v1` both name the API root `.../v1`."""
    url = endpoint.rstrip("/")
    if url.endswith("/chat/completions"):
        url = url[: -len("/chat/completions")]
    return url if url.endswith("/v1") else url + "/v1"


def _headers() -> dict:
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _unreachable(url: str, e: Exception) -> GenerateError:
    return GenerateError(
        f"cannot reach the OpenAI-compatible server at {url} ({type(e).__name__}: {e}). Start the server first "
        "(e.g. `vllm serve MODEL`, `python -m sglang.launch_server --model-path MODEL`, or `transformers serve "
        "DIR --host 127.0.0.1 --port 8000`), check --endpoint (scheme, host, port), or drop --endpoint to "
        "generate in-process with --target. Rows finished so far are kept: rerun the same command to continue."
    )


def resolve_model(endpoint: str, model: str | None, timeout: float = 30.0) -> str:
    """The model name to send: --model, checked against the server's /v1/models; else its only model."""
    url = base_url(endpoint) + "/models"
    try:
        r = httpx.get(url, timeout=min(timeout, 30.0), headers=_headers())
    except httpx.HTTPError as e:
        raise _unreachable(base_url(endpoint), e) from None
    if r.status_code in (401, 403):
        raise GenerateError(f"the server at {url} refused the request (HTTP {r.status_code}); set OPENAI_API_KEY "
                            "to the key it expects.")
    ids = []
    if r.status_code == 200:
        try:
            ids = [str(m["id"]) for m in r.json().get("data", [])]
        except (ValueError, KeyError, TypeError, AttributeError):
            ids = []
    if model:
        if ids and model not in ids:
            raise ConfigError(
                f"--model {model!r} is not served by {base_url(endpoint)}: its /v1/models lists "
                f"{', '.join(repr(i) for i in ids)}. Pass one of those names with --model, or start the server "
                "with the model you mean."
            )
        return model
    if len(ids) == 1:
        return ids[0]
    raise ConfigError(
        f"--model is required with --endpoint {endpoint}: the server lists "
        + (", ".join(repr(i) for i in ids) if ids else "no models at /v1/models")
        + "; pass the name of the target it serves."
    )


def join_reasoning(content: str, reasoning: str | None) -> str:
    if not reasoning or "</think>" in content:
        return content
    return f"<think>\n{reasoning.strip()}\n</think>\n\n{content.lstrip()}"


class EndpointEngine:
    def __init__(self, cfg):
        self.cfg = cfg
        self.url = base_url(cfg.endpoint)
        self.model = resolve_model(cfg.endpoint, cfg.model, cfg.timeout)

    def body(self, req: Request) -> dict:
        b = {"model": self.model, "messages": req.messages, "max_tokens": self.cfg.max_new_tokens,
             "temperature": self.cfg.temperature, "top_p": self.cfg.top_p, "seed": self.cfg.seed + req.key,
             "n": 1, "stream": False}
        kw = template_kwargs(self.cfg.thinking)
        if kw:
            b["chat_template_kwargs"] = kw
        return b

    def generate(self, requests: list[Request], seed: int = 0) -> list[Response]:
        return asyncio.run(self._all(requests))

    async def _all(self, requests: list[Request]) -> list[Response]:
        limits = httpx.Limits(max_connections=self.cfg.concurrency, max_keepalive_connections=self.cfg.concurrency)
        timeout = httpx.Timeout(self.cfg.timeout, connect=min(10.0, self.cfg.timeout))
        sem = asyncio.Semaphore(max(1, self.cfg.concurrency))
        async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=_headers()) as client:
            tasks = [asyncio.create_task(self._one(client, sem, r)) for r in requests]
            try:
                return list(await asyncio.gather(*tasks))
            finally:
                for t in tasks:
                    t.cancel()

    async def _one(self, client: httpx.AsyncClient, sem: asyncio.Semaphore, req: Request) -> Response:
        url = self.url + "/chat/completions"
        last = ""
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                await asyncio.sleep(min(30.0, 0.5 * 2 ** (attempt - 1)) * (1 + 0.25 * random.random()))
            async with sem:
                try:
                    r = await client.post(url, json=self.body(req))
                except httpx.HTTPError as e:
                    last = f"{type(e).__name__}: {e}"
                    continue
            if r.status_code == 200:
                return self._parse(req, r)
            if r.status_code in RETRY_STATUS:
                last = f"HTTP {r.status_code}: {r.text[:200]}"
                continue
            return self._refused(req, r)
        raise GenerateError(
            f"the server at {self.url} did not answer a request for row {req.key} after {self.cfg.retries} retries "
            f"(last: {last}); check that it is up and not overloaded (lower --concurrency, raise --timeout). "
            "Rows finished so far are kept: rerun the same command to continue."
        )

    def _refused(self, req: Request, r: httpx.Response) -> Response:
        text = r.text[:300].replace("\n", " ")
        if r.status_code in (401, 403):
            raise GenerateError(f"the server at {self.url} refused the request (HTTP {r.status_code}: {text}); set "
                                "OPENAI_API_KEY to the key it expects.")
        if r.status_code == 404 and "model" in text.lower():
            raise ConfigError(f"the server at {self.url} does not serve model {self.model!r} (HTTP 404: {text}); "
                              "pass the name it serves with --model.")
        return Response(req.key, None, error=f"HTTP {r.status_code} from the server")

    def _parse(self, req: Request, r: httpx.Response) -> Response:
        try:
            data = r.json()
            choice = data["choices"][0]
            msg = choice["message"]
            text = join_reasoning(msg.get("content") or "", msg.get("reasoning_content") or msg.get("reasoning"))
            tokens = int((data.get("usage") or {}).get("completion_tokens") or 0)
        except (ValueError, KeyError, IndexError, TypeError):
            return Response(req.key, None, error="a reply that is not a chat completion")
        return Response(req.key, text, tokens=tokens, cut=choice.get("finish_reason") == "length")


__all__ = ["EndpointEngine", "base_url", "resolve_model", "join_reasoning"]
