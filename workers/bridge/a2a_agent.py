"""The ``a2a`` protocol: how the bridge calls a remote A2A agent (protocol 1.0, ``a2a-sdk``).

The agent's card is fetched at its first call, and again after a connection failure or a new
registration, by one call at a time (the others waiting for it share its outcome); each time
the interface the bridge calls is checked as a registration checks it
(``a2a_card.checked``), and the SDK is given that interface alone. A card whose interface is
not one agents may reach fails the call ``endpoint_not_allowed`` (retried: the next attempt
reads the card again). A task is one message to that interface: a text part when the payload
is ``{"text": ...}`` alone, else a data part holding the payload; ``metadata.skill`` names
the skill, ``context_id`` is the task's session. A payload A2A cannot carry (a number beyond
a double, nesting past protobuf's 100 levels) fails the task ``payload_invalid``. An agent
whose card says it streams gets ``SendStreamingMessage``: its status updates become the
task's progress (``metadata.percent`` when the agent gives one, else the last percent, with
the status message's text), its artifact updates the task's output. Any other gets
``SendMessage`` returning at once, then ``GetTask`` until its task ends. The result is
``{"text", "artifacts"}``: the text parts of the task's final artifacts joined by newlines,
and each artifact as JSON (``broker.remote.a2a_json``).

What is retried follows the http protocol: a connection that fails, a first event not within
``first_byte_timeout_s``, HTTP 408, 429 and 5xx; never once output was streamed. A task that
ends failed, rejected or cancelled by the agent, or one that wants input, fails at once, as
does any error the agent answers. A cancel or the deadline cancels this coroutine, which
closes the call and sends the agent ``CancelTask`` for its task (best effort, shielded, within
``CANCEL_TIMEOUT_S``); one that comes before the agent named its task first waits up to
``CANCEL_TIMEOUT_S`` for the answer or the first event that names it.

The bridge's calls share one event loop, and the SDK parses each answer and event into
protobuf in Python on it: the transport refuses one of more than ``MAX_ANSWER_ELEMENTS``
before the SDK sees it (``broker.remote.connections``), and the task fails
``agent_protocol``. A payload past ``workers.aio.ON_LOOP_BYTES`` is made protobuf in a
thread (``message_for``). A failure's message is one fixed text per code where the cause is the
bridge's (a card it could not read or may not call, a connection, a timeout): those causes
name addresses and settings, and are logged instead.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, cast

import httpx
from a2a.client import A2AClientError, A2AClientTimeoutError, ClientCallContext, ClientConfig
from a2a.client import Client as A2AClient
from a2a.client.client_factory import ClientFactory
from a2a.types import (
    CancelTaskRequest,
    GetTaskRequest,
    Message,
    Part,
    Role,
    SendMessageRequest,
    StreamResponse,
    Task,
    TaskState,
    TaskStatus,
)
from a2a.utils.errors import A2AError
from google.protobuf import struct_pb2
from google.protobuf.json_format import ParseDict, ParseError

from broker import jsoncodec
from broker.errors import AgentFailure, Retryable
from broker.remote import a2a_card, a2a_json
from broker.remote.connections import (
    MAX_ANSWER_BYTES,
    AiohttpTransport,
    AnswerTooLarge,
    no_cookies,
)
from broker.remote.registration import EndpointNotAllowed
from broker.timestamps import agent_retry_after
from broker.webhooks import signing
from broker.webhooks.ssrf import Guard
from workers.aio import ON_LOOP_BYTES, off_the_loop
from workers.bridge.http_agent import RETRIED_STATUSES
from workers.sdk.context import PROGRESS_MESSAGE_MAX, Context

log = logging.getLogger("reach.bridge")

CANCEL_TIMEOUT_S = 5.0
POLL_FIRST_S, POLL_MAX_S = 0.2, 2.0
POLL_READ_S = 10.0  # a read of the agent's task not answered by then is made again
_FAILED = {
    TaskState.TASK_STATE_FAILED: "agent_task_failed",
    TaskState.TASK_STATE_REJECTED: "agent_task_rejected",
    TaskState.TASK_STATE_CANCELED: "agent_task_canceled",
    TaskState.TASK_STATE_INPUT_REQUIRED: "agent_input_required",
    TaskState.TASK_STATE_AUTH_REQUIRED: "agent_auth_required",
}
_INTERRUPTED = {TaskState.TASK_STATE_INPUT_REQUIRED, TaskState.TASK_STATE_AUTH_REQUIRED}
# What an answer the SDK could not read raises: it reads JSON with ``json``, which raises
# RecursionError past about 1,000 levels of nesting.
_UNREAD = (A2AError, ParseError, ValueError, RecursionError)
# What ``ParseDict`` raises for a payload a protobuf ``Value`` cannot hold: an integer beyond a
# double (the API takes 4,300 digits), nesting past its 100 levels.
_UNSENDABLE = (OverflowError, ParseError, RecursionError)
# The agent's answers that say the call did not fit it: it was made as a card it no longer
# serves said (streaming turned off, an interface moved, a new protocol version). The card is
# read again, and the call made again once when the card it was made from was an older read.
STALE_CARD = frozenset(
    {
        "a2a_unsupported_operation",
        "a2a_method_not_found",
        "a2a_version_not_supported",
        "agent_http_404",
        "agent_http_405",
    }
)
# CancelTask requests in flight: the loop holds its tasks only weakly.
_CANCELLING: set[asyncio.Task[None]] = set()


@dataclass
class Agent:
    """One registration of an A2A agent as the bridge calls it: a new one when it changes, so
    its card is read again then."""

    card_url: str
    secrets: tuple[str, ...]
    guard: Guard  # where agents may be: the card's interface is checked at each fetch
    first_byte_timeout_s: float = 30.0
    card_timeout_s: float = 5.0
    _client: tuple[A2AClient, bool] | None = field(default=None, repr=False)
    _reading: asyncio.Task[tuple[A2AClient, bool]] | None = field(default=None, repr=False)

    async def client(self, transport: AiohttpTransport) -> tuple[A2AClient, bool]:
        """The SDK's client for the card's interface, and whether the agent streams. One
        call at a time reads the card; the others that need it meanwhile wait for that read
        and share its outcome: a hundred first calls read it once, not a hundred times, and
        one call cancelled does not end the read the others wait for."""
        if self._client is not None:
            return self._client
        if self._reading is None:
            # in a context of its own: the read serves every tenant's calls that wait for it,
            # and its log lines and spans carried the first caller's trace id, task and tenant
            nobodys = contextvars.Context()
            loop = asyncio.get_running_loop()
            self._reading = loop.create_task(self._connect(transport), context=nobodys)
            self._reading.add_done_callback(self._read, context=nobodys)
        return await asyncio.shield(self._reading)

    async def _connect(self, transport: AiohttpTransport) -> tuple[A2AClient, bool]:
        session = transport.session()
        fetched = await a2a_card.fetch(session, self.card_url, self.card_timeout_s)
        card = await a2a_card.checked(self.guard, fetched)
        http = httpx.AsyncClient(
            transport=transport,
            timeout=httpx.Timeout(None),  # the task's deadline bounds the call
            follow_redirects=False,
            trust_env=False,
            cookies=no_cookies(),  # every tenant's calls to this agent go through it
            event_hooks={"request": [self._sign]},
        )
        config = ClientConfig(
            streaming=card.capabilities.streaming,
            httpx_client=http,
            supported_protocol_bindings=list(a2a_card.BINDINGS),
        )
        return ClientFactory(config).create(card), card.capabilities.streaming

    def _read(self, reading: asyncio.Task[tuple[A2AClient, bool]]) -> None:
        """Once a read of the card ended: its client kept, or why it failed logged, once for
        every call that waited for it (the calls' tasks say no more than its code)."""
        self._reading = None
        failure = None if reading.cancelled() else reading.exception()
        if isinstance(failure, a2a_card.CardUnavailable | EndpointNotAllowed):
            log.warning("A2A agent card %s: %s", self.card_url, failure.message)
        elif failure is None and not reading.cancelled():
            self._client = reading.result()

    def has_card(self) -> bool:
        """Whether a read of the card is kept (the next call uses it without reading)."""
        return self._client is not None

    def forget_card(self, client: A2AClient) -> None:
        """Read the card again at the next call, unless it was read since ``client`` was
        made: of many calls failing together, the last would otherwise forget the card the
        first had read again."""
        if self._client is not None and self._client[0] is client:
            self._client = None

    async def _sign(self, request: httpx.Request) -> None:
        """Standard Webhooks headers, as on every call of the broker to an agent."""
        message_id = signing.message_id()
        body = request.content
        request.headers.update(signing.headers(self.secrets, message_id, int(time.time()), body))


async def message_for(ctx: Context, skill: str, payload: Any) -> Message:
    """``message_of``, in a thread for a payload past ``ON_LOOP_BYTES``: protobuf's
    ``ParseDict`` is Python over every node (0.65-0.9 s for a MiB), and the loop it would
    hold runs every tenant's calls."""
    if _heavy(payload):
        return await off_the_loop(message_of, ctx, skill, payload)
    return message_of(ctx, skill, payload)


def _heavy(payload: Any) -> bool:
    """Whether a data part's payload is past ``ON_LOOP_BYTES`` as JSON, measured in C (about
    1 ms a MiB); a text part costs no conversion."""
    if not isinstance(payload, dict | list) or _as_text(payload) is not None:
        return False
    try:
        return len(jsoncodec.dumps(payload)) > ON_LOOP_BYTES
    except (TypeError, ValueError, RecursionError):  # ``message_of`` says what it is, there
        return True


def _as_text(payload: Any) -> str | None:
    """The text of a payload that is ``{"text": ...}`` alone, sent as a text part."""
    if isinstance(payload, dict) and payload.keys() == {"text"}:
        text = payload["text"]
        return text if isinstance(text, str) else None
    return None


def message_of(ctx: Context, skill: str, payload: Any) -> Message:
    """The task as an A2A message; AgentFailure ``payload_invalid`` when A2A cannot carry its
    payload or metadata (``_UNSENDABLE``)."""
    try:
        return _message(ctx, skill, payload)
    except _UNSENDABLE as exc:
        reason = "nested too deep" if isinstance(exc, ParseError | RecursionError) else str(exc)
        raise AgentFailure(
            f"an A2A message cannot carry the task's payload: {reason}", code="payload_invalid"
        ) from None


def _message(ctx: Context, skill: str, payload: Any) -> Message:
    text = _as_text(payload)
    if text is not None:
        part = Part(text=text)
    else:
        part = Part(data=ParseDict(payload, struct_pb2.Value()))
    reach = {
        "task_id": str(ctx.task_id),
        "capability": ctx.capability,
        "attempt": ctx.attempt,
        "deadline_at": ctx.deadline_at.isoformat() if ctx.deadline_at else None,
        "metadata": ctx.metadata,
    }
    return Message(
        role=Role.ROLE_USER,
        message_id=f"msg_{uuid.uuid4().hex}",  # one per call: a retry is a new message
        context_id=ctx.session_id or "",
        parts=[part],
        metadata={"skill": skill, "reach": reach},
    )


async def call(
    agent: Agent, transport: AiohttpTransport, skill: str, ctx: Context, payload: Any
) -> Any:
    """The agent's result; raises ``Retryable`` or ``AgentFailure`` as the rules above say. A
    failure at the deadline ends the task ``expired``: the runner's rule for every agent.

    A call the agent refused as not fitting it (``STALE_CARD``) before it began, made from a
    card read before it, is made once more within the same attempt, from the card read again:
    the agent changed (streaming turned off, an interface moved) and did nothing of the task.
    Every call failed so until the bridge restarted, the agent routed all the while."""
    request = SendMessageRequest(message=await message_for(ctx, skill, payload))
    # No history back: the agent's task holds our message in it (and every status message of
    # a long run), so a payload past the answer's element cap came back refused, and a task
    # polled long enough failed on its own history. Nothing here reads it.
    request.configuration.history_length = 0
    kept = agent.has_card()  # a card read before this call, which may have changed since
    try:
        return await _call_once(agent, transport, ctx, request)
    except _Refused as refused:
        if not kept:
            raise refused.failure from None
    log.info("A2A agent %s refused a call as its card had it; card read again", agent.card_url)
    request.message.message_id = f"msg_{uuid.uuid4().hex}"
    try:
        return await _call_once(agent, transport, ctx, request)
    except _Refused as refused:
        raise refused.failure from None


class _Refused(Exception):
    """The agent refused the call before it began, as not fitting it (``STALE_CARD``)."""

    def __init__(self, failure: AgentFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


async def _call_once(
    agent: Agent, transport: AiohttpTransport, ctx: Context, request: SendMessageRequest
) -> Any:
    try:
        client, streams = await agent.client(transport)
    except a2a_card.CardUnavailable:  # logged, with its cause, by ``Agent._read``
        raise Retryable("the agent's card could not be read", code="agent_unreachable") from None
    except EndpointNotAllowed:
        message = "the agent's card names an interface the bridge may not call"
        raise Retryable(message, code="endpoint_not_allowed") from None
    run = _Run(client, ctx)
    try:
        if streams:
            return await run.streamed(request, agent.first_byte_timeout_s)
        return await run.polled(request, agent.first_byte_timeout_s)
    except asyncio.CancelledError:
        await run.cancel_remote()
        raise
    except _UNREAD as exc:
        failure = failure_of(exc, streamed=run.streamed_output)
        stale = failure.code in STALE_CARD
        if isinstance(failure, Retryable) or failure.code == "agent_stream_broken" or stale:
            agent.forget_card(client)  # the agent may have moved: read its card again
        await run.given_up()
        if stale and not run.task_id and not run.streamed_output:
            raise _Refused(failure) from None
        raise failure from None
    except AgentFailure:
        await run.given_up()
        raise


@dataclass
class _Done:
    result: Any


@dataclass
class _Run:
    """One call's state: the agent's task, its artifacts so far, what was reported."""

    client: A2AClient
    ctx: Context
    task_id: str = ""
    # At most what an ``http`` agent's answer may be: they are the task's result.
    artifacts: a2a_json.Artifacts = field(
        default_factory=lambda: a2a_json.Artifacts(MAX_ANSWER_BYTES)
    )
    streamed_output: bool = False
    over: bool = False  # the agent said its task ended
    percent: float = 0.0
    reported: tuple[float | None, str] | None = None  # the last status shown as progress

    def call_context(self) -> ClientCallContext:
        """The task's trace for one request: its ``traceparent`` with a parent id of its own,
        as each ``http`` call's has (every poll and the cancel had the first request's)."""
        return ClientCallContext(service_parameters=self.ctx.trace_headers())

    async def streamed(self, request: SendMessageRequest, first_byte_timeout_s: float) -> Any:
        # An async generator, though typed as an iterator: closing it closes the call.
        stream = cast(
            AsyncGenerator[StreamResponse, None],
            self.client.send_message(request, context=self.call_context()),
        )
        async with aclosing(stream) as events:
            event = await self.first(events, first_byte_timeout_s, "event")
            while event is not None:
                done = await self.take(event)
                if done is not None:
                    return done.result
                event = await anext(events, None)
        if not self.task_id:
            raise self._broken("the stream ended before the agent named its task")
        # The last state may have been written after the stream closed: read it.
        return await self.polled_from(POLL_FIRST_S)

    async def polled(self, request: SendMessageRequest, first_byte_timeout_s: float) -> Any:
        """The message sent for an answer at once (``return_immediately``), within
        ``first_byte_timeout_s`` (else retried, as a stream's first event is), then the task
        polled until it ends."""
        request.configuration.return_immediately = True
        done = None
        stream = cast(
            AsyncGenerator[StreamResponse, None],
            self.client.send_message(request, context=self.call_context()),
        )
        async with aclosing(stream) as events:
            event = await self.first(events, first_byte_timeout_s, "answer")
            while event is not None:  # the answer: one event
                done = await self.take(event)
                event = await anext(events, None)
        if done is not None:
            return done.result
        if not self.task_id:
            raise AgentFailure("the agent answered no task", code="agent_protocol")
        return await self.polled_from(POLL_FIRST_S)

    async def first(
        self, events: AsyncGenerator[StreamResponse, None], timeout_s: float, what: str
    ) -> StreamResponse | None:
        """The call's first event (or its answer), within ``timeout_s``, else retried as
        ``agent_timeout``. It is read in a task of its own: a cancel (the caller's, the
        deadline) that comes before it reads on for up to ``CANCEL_TIMEOUT_S`` more, for the
        task it names, which ``cancel_remote`` then cancels. A2A cancels a task, never a
        message: a call closed before the agent named its task left it working."""
        reading = asyncio.ensure_future(anext(events, None))
        try:
            await asyncio.wait({reading}, timeout=timeout_s)
        except asyncio.CancelledError:
            try:
                await asyncio.wait({reading}, timeout=CANCEL_TIMEOUT_S)
                if reading.done() and not reading.cancelled() and reading.exception() is None:
                    self.task_id = _task_named(reading.result())
            finally:
                await _stopped(reading)
            raise
        if not reading.done():
            await _stopped(reading)
            raise Retryable(f"no {what} within {timeout_s:g}s", code="agent_timeout")
        return reading.result()

    async def polled_from(self, wait_s: float) -> Any:
        """The agent's task read until it ends; a read not answered within ``POLL_READ_S``
        is given up and made again (the task's deadline bounds them all): one that never
        answered held the call to its deadline, whatever the task did meanwhile."""
        while True:
            try:
                async with asyncio.timeout(POLL_READ_S):
                    task = await self.client.get_task(
                        GetTaskRequest(id=self.task_id, history_length=0),
                        context=self.call_context(),
                    )
            except TimeoutError:
                task = None
            done = await self.take(StreamResponse(task=task)) if task is not None else None
            if done is not None:
                return done.result
            await asyncio.sleep(wait_s)
            wait_s = min(2 * wait_s, POLL_MAX_S)

    async def take(self, event: StreamResponse) -> _Done | None:
        """Apply one event of the agent's; the outcome once the task ended."""
        if event.HasField("message"):
            return _Done(a2a_json.message_result(event.message))
        if event.HasField("task"):
            task: Task = event.task
            self.task_id = task.id
            self.artifacts.replace_all(task.artifacts)
            return await self.status(task.status, {})
        if event.HasField("artifact_update"):
            chunk = event.artifact_update
            self.task_id = self.task_id or chunk.task_id
            self.artifacts.apply(chunk)
            await self.ctx.emit_async(a2a_json.update_output(chunk))
            self.streamed_output = True
            return None
        if event.HasField("status_update"):
            update = event.status_update
            self.task_id = self.task_id or update.task_id
            return await self.status(update.status, a2a_json.to_json(update.metadata))
        return None

    async def status(self, status: TaskStatus, metadata: Mapping[str, Any]) -> _Done | None:
        text = a2a_json.text_of(status.message.parts) if status.HasField("message") else ""
        if status.state == TaskState.TASK_STATE_COMPLETED:
            if self.artifacts.size <= ON_LOOP_BYTES:
                return _Done(self.artifacts.result())
            # Appended chunks, each within an answer's elements, may come to 16 MiB: read in
            # Python, on the loop every call shares, they held it 2 s.
            return _Done(await off_the_loop(self.artifacts.result))
        if status.state in _FAILED:
            if status.state in _INTERRUPTED:
                await self.cancel_remote()  # nobody here can give it input: free its slot
            self.over = True
            state = TaskState.Name(status.state).removeprefix("TASK_STATE_").lower()
            raise AgentFailure(
                text or f"the agent's task ended {state}", code=_FAILED[status.state]
            )
        percent = a2a_json.percent_of(metadata, status)
        if (text or percent is not None) and (percent, text) != self.reported:
            self.reported = (percent, text)  # a polled task shows the same status many times
            self.percent = self.percent if percent is None else percent
            await self.ctx.progress_async(self.percent, text[:PROGRESS_MESSAGE_MAX] or None)
        return None

    async def given_up(self) -> None:
        """The call failed here (a stream that broke, an answer too large): the agent's task,
        if it named one and did not say it ended, is cancelled. A retry sends a new message,
        a new task for the agent (A2A has no idempotency key): the first ran on beside it."""
        if not self.over:
            await self.cancel_remote()

    async def cancel_remote(self) -> None:
        """``CancelTask`` for the agent's task: best effort, and shielded from a second
        cancel, so the agent hears it even while this call is being torn down. The request
        itself ends within ``CANCEL_TIMEOUT_S``, answered or not: a wait for it that gave up
        left it running (the SDK's client has no timeout), holding its connection for as
        long as the agent kept it open."""
        if not self.task_id:
            return
        cancelling = asyncio.ensure_future(self._cancel_task(self.task_id))
        _CANCELLING.add(cancelling)
        cancelling.add_done_callback(_CANCELLING.discard)
        await asyncio.shield(cancelling)

    async def _cancel_task(self, task_id: str) -> None:
        try:
            async with asyncio.timeout(CANCEL_TIMEOUT_S):
                request = CancelTaskRequest(id=task_id)
                await self.client.cancel_task(request, context=self.call_context())
        except (*_UNREAD, TimeoutError) as exc:
            log.info("CancelTask for the agent's task %s failed: %r", task_id, exc)

    def _broken(self, message: str) -> AgentFailure:
        if self.streamed_output:
            return AgentFailure(message, code="agent_stream_broken")
        return Retryable(message, code="agent_unreachable")


def _task_named(event: StreamResponse | None) -> str:
    """The id of the agent's task an event is about ('' for a message, or no event)."""
    if event is None:
        return ""
    if event.HasField("task"):
        return str(event.task.id)
    if event.HasField("status_update"):
        return str(event.status_update.task_id)
    if event.HasField("artifact_update"):
        return str(event.artifact_update.task_id)
    return ""


async def _stopped(reading: asyncio.Future[Any]) -> None:
    """A read given up: cancelled, and waited for, so that closing the call after it does
    not find the stream still being read."""
    reading.cancel()
    await asyncio.wait({reading})
    if not reading.cancelled():
        reading.exception()  # read: an error it ended with meanwhile is not logged as lost


def failure_of(exc: Exception, *, streamed: bool) -> AgentFailure:
    """The task's failure for an error of the SDK's: the network's are retried before any
    output, the agent's answers never."""
    if isinstance(exc, A2AClientTimeoutError):
        return _transient("the agent did not answer in time", "agent_timeout", streamed)
    if isinstance(exc, A2AClientError):
        cause = exc.__cause__
        if isinstance(cause, httpx.HTTPStatusError):
            status = cause.response.status_code
            message = f"the agent answered {status}"
            if status in RETRIED_STATUSES and not streamed:
                wait_s = agent_retry_after(cause.response.headers.get("Retry-After"))
                return Retryable(message, code=f"agent_http_{status}", delay_s=wait_s)
            return AgentFailure(message, code=f"agent_http_{status}")
        if isinstance(cause, AnswerTooLarge):
            return AgentFailure(str(cause), code="agent_protocol")
        if isinstance(cause, httpx.RequestError):  # its text may name the agent's address
            log.warning("an A2A agent's call failed: %s: %s", type(cause).__name__, cause)
            if isinstance(cause, httpx.TransportError):
                message = "the connection to the agent failed"
                return _transient(message, "agent_unreachable", streamed)
            return AgentFailure("the agent's answer could not be read", code="agent_protocol")
        return AgentFailure(str(exc)[:2000], code="agent_protocol")
    if isinstance(exc, A2AError):
        return AgentFailure(_named_nowhere(exc)[:2000], code=a2a_json.error_code(exc))
    return AgentFailure(f"the agent's answer is not A2A: {exc}"[:2000], code="agent_protocol")


def _named_nowhere(exc: A2AError) -> str:
    """An A2A error's message, unless it names the agent's host: the SDK writes the request's
    URL into the error it makes of an HTTP error answer without a message of its own ("Resource
    not found: http://10.0.0.5:8384/a2a/rest/message:send", httpx's "for url ..."), which
    the task's error would show its tenant. Then the status alone; the log has the text."""
    message = str(exc)
    cause = exc.__cause__
    if isinstance(cause, httpx.HTTPStatusError) and cause.request.url.host in message:
        log.warning("an A2A agent answered %s: %s", cause.response.status_code, message)
        return f"the agent answered {cause.response.status_code}"
    return message


def _transient(message: str, code: str, streamed: bool) -> AgentFailure:
    if streamed:
        return AgentFailure(message, code="agent_stream_broken")
    return Retryable(message, code=code)
