"""``llm.complete``: an async agent that awaits a model API and streams its tokens.

It calls an OpenAI-compatible ``/v1/chat/completions`` at ``REACH_MODEL_URL`` (a real server,
or ``python -m reach.fakemodel``), with the task's trace headers. With ``"stream": true`` each
token the model sends becomes an ``output`` event as it arrives.

The client is aiohttp, one session per worker process. Measured with
``python -m bench.clients`` against a model that answers after 500 ms, 2,000 calls with 500
in flight from one event loop: aiohttp 838 calls/s, ``httpx.AsyncClient`` 40/s (its pool is
the bottleneck at this concurrency; see ``docs/performance.md``). Run it on the threads
pool: ``-P threads -c 500``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any

import aiohttp

from workers.sdk import AgentFailure, Context, Retryable, agent

log = logging.getLogger("reach.examples.model")

MODEL_URL_ENV = "REACH_MODEL_URL"
DEFAULT_MODEL_URL = "http://127.0.0.1:8700"
CONNECT_TIMEOUT_S = 5.0
_sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}

INPUT_SCHEMA = {
    "type": "object",
    "required": ["prompt"],
    "properties": {
        "prompt": {"type": "string", "minLength": 1, "maxLength": 100_000},
        "stream": {"type": "boolean"},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": 4096},
        "model": {"type": "string", "maxLength": 128},
    },
    "additionalProperties": False,
}


def _session() -> aiohttp.ClientSession:
    """The process's session, on the running loop: no limit on connections (the worker's
    concurrency is the limit), keep-alive, connect bounded, the rest by the task's time."""
    loop = asyncio.get_running_loop()
    session = _sessions.get(loop)
    if session is None or session.closed:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
        session = _sessions[loop] = aiohttp.ClientSession(connector=connector, timeout=timeout)
    return session


@agent.capability(
    "llm.complete",
    agent_id="llm-complete",
    version="0.1.0",
    input_schema=INPUT_SCHEMA,
    timeout_s=120,
    idempotent=True,
    streaming=True,
    max_attempts=3,
)
async def complete(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    """Ask the model; with ``stream``, each token is an output event as it arrives."""
    stream = bool(payload.get("stream", False))
    request = {
        "model": payload.get("model", "default"),
        "messages": [{"role": "user", "content": payload["prompt"]}],
        "max_tokens": payload.get("max_tokens", 256),
        "stream": stream,
    }
    url = os.environ.get(MODEL_URL_ENV, DEFAULT_MODEL_URL).rstrip("/") + "/v1/chat/completions"
    try:
        async with _session().post(url, json=request, headers=ctx.trace_headers()) as response:
            if response.status == 429 or response.status >= 500:
                raise Retryable(f"the model answered {response.status}", code="model_busy")
            if response.status >= 400:
                detail = (await response.text())[:500]
                raise AgentFailure(f"the model refused: {response.status} {detail}")
            if not stream:
                answer = await response.json()
                return {"text": answer["choices"][0]["message"]["content"]}
            return {"text": await _tokens(ctx, response)}
    except aiohttp.ClientConnectionError as exc:
        # The caller sees the code, not the model's address (aiohttp's text names it): the
        # worker's log has it.
        log.warning("the model at %s cannot be reached: %s", url, exc)
        raise Retryable("the model cannot be reached", code="model_unreachable") from exc


async def _tokens(ctx: Context, response: aiohttp.ClientResponse) -> str:
    """Read the server-sent chunks, emitting each token; the whole text at the end."""
    text: list[str] = []
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[len(b"data:") :].strip()
        if data == b"[DONE]":
            break
        token = json.loads(data)["choices"][0].get("delta", {}).get("content")
        if token:
            text.append(token)
            await ctx.emit_async({"token": token})
    return "".join(text)
