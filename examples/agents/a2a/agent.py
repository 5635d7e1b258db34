"""A small A2A agent (protocol 1.0), served with ``a2a-sdk``'s server side.

    .venv/bin/python examples/agents/a2a/agent.py --port 9100
    # card at http://127.0.0.1:9100/.well-known/agent-card.json

Skills, picked by the message's ``metadata.skill``:

- ``summarize``: the text of a text part, or ``text`` of a data part. It streams: a WORKING
  status, then the artifact ``summary`` one sentence at a time (``delay_s`` of the data part
  before each, 0 by default), then the data artifact ``stats`` (``{"sentences": n}``), then
  COMPLETED. A cancel stops it.
- ``echo``: answers at once with a data artifact equal to the data part it got.

A data part with ``fail`` ends either task FAILED with that text; one with ``start_delay_s``
waits that long before the agent names its task (its first event, or its answer).
``GET /stats`` shows what the broker's tests check: the tasks cancelled (with the broker's
task id the message carried), the last message's context and metadata, the last request's
path and headers. Tasks live in memory: it is an example, not a deployment.
"""

from __future__ import annotations

import argparse
import asyncio
import re
from typing import Any

import uvicorn
from a2a.helpers import get_data_parts, get_text_parts, new_task_from_user_message
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import (
    create_agent_card_routes,
    create_jsonrpc_routes,
    create_rest_routes,
)
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types import AgentCapabilities, AgentCard, AgentInterface, AgentSkill, Part
from google.protobuf import struct_pb2
from google.protobuf.json_format import MessageToDict, ParseDict
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

JSONRPC_PATH, REST_PATH = "/a2a/jsonrpc", "/a2a/rest"
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


class Stats:
    def __init__(self) -> None:
        self.broker_ids: dict[str, str] = {}  # our task id -> the broker's, when it says
        self.cancelled: list[dict[str, str | None]] = []
        self.last_message: dict[str, Any] = {}
        self.last_request: dict[str, Any] = {}
        self.traceparents: list[str] = []  # of the last 100 POSTs, oldest first

    def view(self) -> dict[str, Any]:
        return {
            "cancelled": self.cancelled,
            "last_message": self.last_message,
            "last_request": self.last_request,
            "traceparents": self.traceparents,
        }


class Executor(AgentExecutor):
    def __init__(self, stats: Stats) -> None:
        self.stats = stats

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        message = context.message
        assert message is not None and context.task_id and context.context_id
        metadata = MessageToDict(message.metadata)
        self.stats.last_message = {"context_id": message.context_id, "metadata": metadata}
        if isinstance(metadata.get("reach"), dict):
            self.stats.broker_ids[context.task_id] = metadata["reach"].get("task_id")
        data = next(iter(get_data_parts(message.parts)), None)
        given = data if isinstance(data, dict) else {}
        if context.current_task is None:
            await asyncio.sleep(float(given.get("start_delay_s", 0)))
            await event_queue.enqueue_event(new_task_from_user_message(message))
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        if "fail" in given:
            await updater.failed(updater.new_agent_message([Part(text=str(given["fail"]))]))
        elif metadata.get("skill") == "echo":
            await updater.add_artifact([_data(data)], name="echo", last_chunk=True)
            await updater.complete()
        elif metadata.get("skill") == "summarize":
            text = "\n".join(get_text_parts(message.parts)) or str(given.get("text", ""))
            await summarize(updater, text, float(given.get("delay_s", 0)))
        else:
            skill = metadata.get("skill")
            await updater.reject(updater.new_agent_message([Part(text=f"no skill {skill!r}")]))

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id and context.context_id
        broker_id = self.stats.broker_ids.get(context.task_id)
        self.stats.cancelled.append({"task_id": context.task_id, "reach_task_id": broker_id})
        await TaskUpdater(event_queue, context.task_id, context.context_id).cancel()


async def summarize(updater: TaskUpdater, text: str, delay_s: float) -> None:
    """One artifact update per sentence, each adding to the artifact ``summary``."""
    sentences = [s for s in SENTENCE_END.split(text.strip()) if s]
    status = f"summarizing {len(sentences)} sentences"
    await updater.start_work(updater.new_agent_message([Part(text=status)]))
    for i, sentence in enumerate(sentences):
        await asyncio.sleep(delay_s)
        await updater.add_artifact(
            [Part(text=sentence)],
            artifact_id="summary",
            name="summary",
            append=i > 0,
            last_chunk=i == len(sentences) - 1,
        )
    await updater.add_artifact([_data({"sentences": len(sentences)})], name="stats")
    await updater.complete()


def _data(value: Any) -> Part:
    return Part(data=ParseDict(value, struct_pb2.Value()))


def agent_card(base_url: str, *, streaming: bool, binding: str) -> AgentCard:
    interfaces = [
        AgentInterface(
            url=base_url + JSONRPC_PATH, protocol_binding="JSONRPC", protocol_version="1.0"
        ),
        AgentInterface(
            url=base_url + REST_PATH, protocol_binding="HTTP+JSON", protocol_version="1.0"
        ),
    ]
    if binding == "rest":
        interfaces.reverse()  # the first is the one the agent prefers
    return AgentCard(
        name="Example A2A agent",
        description="Summarizes text sentence by sentence, and echoes data.",
        version="1.0.0",
        supported_interfaces=interfaces,
        capabilities=AgentCapabilities(streaming=streaming),
        default_input_modes=["text/plain", "application/json"],
        default_output_modes=["text/plain", "application/json"],
        skills=[
            AgentSkill(
                id="summarize",
                name="Summarize",
                description="Streams a text back one sentence at a time.",
                tags=["text"],
            ),
            AgentSkill(
                id="echo",
                name="Echo",
                description="Answers with the data it was sent.",
                tags=["data"],
            ),
        ],
    )


class RecordRequests:
    """Keeps the path and headers of the last POST, and the ``traceparent`` of the last 100,
    for ``/stats``."""

    def __init__(self, app: ASGIApp, stats: Stats) -> None:
        self.app, self.stats = app, stats

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
            self.stats.last_request = {"path": scope["path"], "headers": headers}
            self.stats.traceparents = [*self.stats.traceparents, headers.get("traceparent", "")][
                -100:
            ]
        await self.app(scope, receive, send)


def create_app(base_url: str, *, streaming: bool = True, binding: str = "jsonrpc") -> ASGIApp:
    stats = Stats()
    card = agent_card(base_url, streaming=streaming, binding=binding)
    handler = DefaultRequestHandler(Executor(stats), InMemoryTaskStore(), card)

    async def show_stats(request: Request) -> JSONResponse:
        return JSONResponse(stats.view())

    # The card and /stats first: the REST routes end with a catch-all mount per tenant.
    routes = [
        *create_agent_card_routes(card),
        Route("/stats", show_stats, methods=["GET"]),
        *create_jsonrpc_routes(handler, rpc_url=JSONRPC_PATH),
        *create_rest_routes(handler, path_prefix=REST_PATH),
    ]
    return RecordRequests(Starlette(routes=routes), stats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9100)
    parser.add_argument("--binding", choices=["jsonrpc", "rest"], default="jsonrpc")
    parser.add_argument("--no-streaming", action="store_true", help="a card without streaming")
    args = parser.parse_args()
    base_url = f"http://{args.host}:{args.port}"
    app = create_app(base_url, streaming=not args.no_streaming, binding=args.binding)
    print(f"card at {base_url}/.well-known/agent-card.json", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
