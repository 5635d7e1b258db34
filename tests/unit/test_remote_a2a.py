"""The ``a2a`` protocol's rules that need no network: cards read into ours
(``broker.remote.a2a_card``), A2A's messages as JSON (``broker.remote.a2a_json``), and which
failures are retried (``workers.bridge.a2a_agent``)."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from typing import Any

import httpx
import pytest
from a2a.client import A2AClientError, A2AClientTimeoutError
from a2a.types import (
    Artifact,
    Message,
    Part,
    SendMessageRequest,
    StreamResponse,
    Task,
    TaskArtifactUpdateEvent,
    TaskState,
    TaskStatus,
)
from a2a.utils.errors import A2AError, InvalidParamsError, MethodNotFoundError, TaskNotFoundError
from google.protobuf import struct_pb2
from google.protobuf.json_format import ParseDict

from broker.errors import AgentFailure, Retryable
from broker.remote import a2a_card, a2a_json
from broker.remote.connections import MAX_ANSWER_BYTES, AnswerTooLarge
from broker.remote.registration import EndpointNotAllowed, Registration, RegistrationInvalid
from broker.webhooks.ssrf import Guard
from workers.aio import ON_LOOP_BYTES
from workers.bridge import a2a_agent
from workers.bridge.a2a_agent import _Run, failure_of, message_of
from workers.sdk.context import Context


def card_json(**more: Any) -> dict[str, Any]:
    return {
        "name": "Travel",
        "description": "Books trips.",
        "version": "2.0.0",
        "supportedInterfaces": [
            {"url": "http://10.0.0.7/rpc", "protocolBinding": "JSONRPC", "protocolVersion": "1.0"}
        ],
        "capabilities": {"streaming": True},
        "skills": [
            {"id": "find-flights", "name": "Find flights", "description": "Searches flights."},
            {"id": "book", "name": "Book", "description": ""},
        ],
        **more,
    }


def registration(prefix: str = "travel") -> Registration:
    return Registration.model_validate(
        {
            "version": "1.0.0",
            "endpoint": {"protocol": "a2a", "url": "http://10.0.0.7/card"},
            "capability_prefix": prefix,
        }
    )


def interface_at(url: str, version: str = "") -> dict[str, str]:
    return {"url": url, "protocolBinding": "JSONRPC", "protocolVersion": version}


def data(value: Any) -> Part:
    return Part(data=ParseDict(value, struct_pb2.Value()))


@pytest.mark.parametrize(
    ("skill_id", "name"),
    [
        ("summarize", "travel.summarize"),
        ("Find Flights", "travel.find-flights"),
        ("hotels/book_room", "travel.hotels-book_room"),
        ("flights.search", "travel.flights.search"),
        ("--edge--", "travel.edge"),
    ],
)
def test_a_skill_id_is_made_a_capability_name_under_the_prefix(skill_id: str, name: str) -> None:
    assert a2a_card.capability_name("travel", skill_id) == name


@pytest.mark.parametrize("skill_id", ["1st", "", "a..b", "pidbox", "***", "x" * 200])
def test_a_skill_id_that_makes_no_valid_name_is_refused(skill_id: str) -> None:
    with pytest.raises(RegistrationInvalid):
        a2a_card.capability_name("travel", skill_id)


def test_each_skill_of_the_card_becomes_a_card_of_ours() -> None:
    card = a2a_card.parse(json.dumps(card_json()).encode())
    documents = a2a_card.documents("travel-agent", registration(), card)
    assert [d["capability"] for d in documents] == ["travel.find-flights", "travel.book"]
    first, second = documents
    assert first["description"] == "Searches flights."
    assert first["display_name"] == "Find flights"
    assert first["streaming"] is True
    assert first["cancellable"] is True
    assert first["version"] == "1.0.0"  # the registration's, not the card's
    assert first["endpoint"] == {"protocol": "a2a", "skill": "find-flights"}
    assert second["description"] == "Books trips."  # the card's, when the skill has none


def test_a_card_of_more_elements_than_a_card_needs_is_refused_before_protobuf_reads_it() -> None:
    """Protobuf reads a card in Python on the loop every call of the bridge shares: 1 MiB of
    empty skills held it 1.6 s, at every health check."""
    body = json.dumps(card_json(skills=[{}] * (a2a_card.MAX_CARD_ELEMENTS + 1))).encode()
    assert len(body) < a2a_card.MAX_CARD_BYTES
    with pytest.raises(a2a_card.CardUnavailable, match="elements"):
        a2a_card.parse(body)
    # and a card of 64 skills of 60 tags and 60 examples each is read
    skill = {"name": "n", "description": "d", "tags": ["t"] * 60, "examples": ["e"] * 60}
    skills = [{"id": f"skill-{i}", **skill} for i in range(64)]
    assert len(a2a_card.parse(json.dumps(card_json(skills=skills)).encode()).skills) == 64


def test_skills_that_make_the_same_name_are_refused() -> None:
    skills = [{"id": "Book", "name": "a"}, {"id": "book", "name": "b"}]
    card = a2a_card.parse(json.dumps(card_json(skills=skills)).encode())
    with pytest.raises(RegistrationInvalid, match="both"):
        a2a_card.documents("travel-agent", registration(), card)


@pytest.mark.parametrize("prefix", ["reach", "Travel", "celery.x"])
def test_a_prefix_that_is_no_capability_name_is_refused(prefix: str) -> None:
    card = a2a_card.parse(json.dumps(card_json()).encode())
    with pytest.raises(RegistrationInvalid):
        a2a_card.documents("travel-agent", registration(prefix), card)


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[1, 2]",
        json.dumps(card_json(skills="many")).encode(),
        json.dumps(card_json(supportedInterfaces=[])).encode(),
        json.dumps(
            card_json(supportedInterfaces=[{"url": "x:1", "protocolBinding": "GRPC"}])
        ).encode(),
        # A version the a2a-sdk makes no client for.
        json.dumps(card_json(supportedInterfaces=[interface_at("http://a/", "0.2")])).encode(),
        b"[" * 10_000,  # json raised RecursionError: registration answered 500
    ],
)
def test_what_is_not_a_card_the_bridge_can_call_is_unavailable(body: bytes) -> None:
    with pytest.raises(a2a_card.CardUnavailable):
        a2a_card.parse(body)


def resolving(host: str, port: int) -> list[str]:
    """Every name at one public address; an address is itself."""
    return [host] if host[0].isdigit() else ["93.184.216.34"]


def test_the_interface_called_is_the_cards_first_the_bridge_speaks_whatever_the_versions() -> None:
    """The a2a-sdk, given the card, would call the interface of version 1.0: the bridge calls
    the card's first, and gives the SDK that one alone."""
    interfaces = [
        {"url": "grpc://agent.example.com", "protocolBinding": "GRPC"},
        interface_at("https://old.example.com/rpc", "0.2"),
        interface_at("https://agent.example.com/rpc"),
        interface_at("http://169.254.169.254/latest/", "1.0"),
    ]
    card = a2a_card.parse(json.dumps(card_json(supportedInterfaces=interfaces)).encode())
    called = a2a_card.interface(card)
    assert called is not None and called.url == "https://agent.example.com/rpc"
    trimmed = asyncio.run(a2a_card.checked(Guard(resolver=resolving), card))
    assert list(trimmed.supported_interfaces) == [called]
    assert [s.id for s in trimmed.skills] == ["find-flights", "book"]


def test_a_card_whose_interface_may_not_be_reached_is_refused_however_it_came() -> None:
    interfaces = [interface_at("http://169.254.169.254/latest/", "1.0")]
    card = a2a_card.parse(json.dumps(card_json(supportedInterfaces=interfaces)).encode())
    with pytest.raises(EndpointNotAllowed, match="the card's JSONRPC interface"):
        asyncio.run(a2a_card.checked(Guard(allow=["10.0.0.0/8"], resolver=resolving), card))


def test_a_card_of_protocol_0_3_is_read_too() -> None:
    legacy = {
        "name": "Old",
        "description": "",
        "version": "1",
        "url": "http://10.0.0.7/",
        "preferredTransport": "JSONRPC",
        "protocolVersion": "0.3.0",
        "capabilities": {},
        "skills": [{"id": "old", "name": "Old", "description": "d", "tags": []}],
    }
    card = a2a_card.parse(json.dumps(legacy).encode())
    assert a2a_card.interface(card) is not None
    assert card.capabilities.streaming is False


def ctx(**more: Any) -> Context:
    return Context(
        task_id=uuid.uuid4(), capability="travel.book", trace_id="t" * 32, attempt=2, **more
    )


def test_a_text_only_payload_is_sent_as_a_text_part_anything_else_as_data() -> None:
    as_text = message_of(ctx(session_id="trip-1"), "book", {"text": "to Lisbon"})
    assert [p.WhichOneof("content") for p in as_text.parts] == ["text"]
    assert as_text.parts[0].text == "to Lisbon"
    assert as_text.context_id == "trip-1"
    as_data = message_of(ctx(), "book", {"text": "to Lisbon", "nights": 3})
    assert a2a_json.to_json(as_data.parts[0].data) == {"text": "to Lisbon", "nights": 3}
    assert as_data.context_id == ""
    metadata = a2a_json.to_json(as_data.metadata)
    assert metadata["skill"] == "book"
    assert metadata["reach"]["attempt"] == 2


def test_whole_numbers_come_back_as_integers_and_others_unchanged() -> None:
    value = {"n": 3, "big": 2**60, "f": 1.5, "list": [1, 2.0, None, True, "s"]}
    back = a2a_json.to_json(ParseDict(value, struct_pb2.Value()))
    assert back["n"] == 3 and isinstance(back["n"], int)
    assert back["list"] == [1, 2, None, True, "s"]
    assert back["f"] == 1.5
    assert isinstance(back["big"], float)  # past 2**53 a double is not exact: left as it is


def test_appended_chunks_build_one_artifact_and_the_text_joins_every_text_part() -> None:
    artifacts = a2a_json.Artifacts(MAX_ANSWER_BYTES)
    for i, text in enumerate(["One.", "Two."]):
        artifacts.apply(
            TaskArtifactUpdateEvent(
                artifact=Artifact(artifact_id="s", name="summary", parts=[Part(text=text)]),
                append=i > 0,
            )
        )
    artifacts.apply(TaskArtifactUpdateEvent(artifact=Artifact(artifact_id="d", parts=[data(1)])))
    result = artifacts.result()
    assert result["text"] == "One.\nTwo."
    assert result["artifacts"] == [
        {"artifact_id": "s", "name": "summary", "parts": [{"text": "One."}, {"text": "Two."}]},
        {"artifact_id": "d", "parts": [{"data": 1}]},
    ]
    artifacts.apply(TaskArtifactUpdateEvent(artifact=Artifact(artifact_id="s", parts=[])))
    assert artifacts.result()["artifacts"][0]["parts"] == []  # no append: replaced


def chunk_of(artifact_id: str, text: str, *, append: bool) -> TaskArtifactUpdateEvent:
    artifact = Artifact(artifact_id=artifact_id, parts=[Part(text=text)])
    return TaskArtifactUpdateEvent(artifact=artifact, append=append)


def test_artifacts_appended_past_the_cap_fail_the_task() -> None:
    """The bridge holds a task's artifacts until it ends (they are its result): an agent that
    appends small chunks for ever fails it with ``agent_protocol`` at ``MAX_ANSWER_BYTES``,
    the most an ``http`` agent's result may be."""
    artifacts = a2a_json.Artifacts(MAX_ANSWER_BYTES)
    with pytest.raises(AgentFailure) as failed:
        for _ in range(MAX_ANSWER_BYTES // 2**16 + 1):
            artifacts.apply(chunk_of("s", "x" * 2**16, append=True))
    assert failed.value.code == "agent_protocol"


def test_a_large_result_is_read_off_the_loop_and_a_small_one_on_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Appended chunks, each within an answer's elements, may come to 16 MiB: read into the
    task's result in Python on the loop every call shares, they held it 2 s."""
    threads: list[str] = []
    result = a2a_json.Artifacts.result

    def recorded(self: a2a_json.Artifacts) -> dict[str, Any]:
        threads.append(threading.current_thread().name)
        return result(self)

    monkeypatch.setattr(a2a_json.Artifacts, "result", recorded)

    async def finished(size: int) -> Any:
        run = _Run(client=None, ctx=Traced())  # type: ignore[arg-type]
        run.artifacts.apply(chunk_of("s", "x" * size, append=True))
        done = await run.status(TaskStatus(state=TaskState.TASK_STATE_COMPLETED), {})
        assert done is not None
        return done.result

    for size in (100, 2 * ON_LOOP_BYTES):
        assert asyncio.run(finished(size))["text"] == "x" * size
    loop_thread = threading.current_thread().name
    assert threads[0] == loop_thread and threads[1] != loop_thread


def test_artifacts_replaced_count_once() -> None:
    artifacts = a2a_json.Artifacts(MAX_ANSWER_BYTES)
    for _ in range(MAX_ANSWER_BYTES // 2**20 + 1):
        artifacts.apply(chunk_of("s", "x" * 2**20, append=False))
    assert len(artifacts.result()["text"]) == 2**20


def test_an_update_is_output_with_its_chunk_and_flags() -> None:
    update = TaskArtifactUpdateEvent(
        artifact=Artifact(artifact_id="s", parts=[Part(url="http://x/f.pdf", filename="f.pdf")]),
        append=True,
        last_chunk=True,
    )
    assert a2a_json.update_output(update) == {
        "artifact_id": "s",
        "parts": [{"url": "http://x/f.pdf", "filename": "f.pdf"}],
        "append": True,
        "last_chunk": True,
    }


def test_a_message_answer_is_a_result_of_one_artifact() -> None:
    message = Message(message_id="m1", parts=[Part(text="hi"), data({"a": 1})])
    assert a2a_json.message_result(message) == {
        "text": "hi",
        "artifacts": [{"artifact_id": "m1", "parts": [{"text": "hi"}, {"data": {"a": 1}}]}],
    }


def test_a_percent_is_read_from_the_update_or_its_message_else_none() -> None:
    status = TaskStatus(message=Message(metadata={"percent": 40}))
    assert a2a_json.percent_of({"percent": 150}, status) == 100.0
    assert a2a_json.percent_of({}, status) == 40.0
    assert a2a_json.percent_of({"percent": True}, TaskStatus()) is None


def _client_error(cause: Exception) -> A2AClientError:
    try:
        raise A2AClientError(str(cause)) from cause
    except A2AClientError as exc:
        return exc


def test_connection_failures_and_timeouts_are_retried_only_before_any_output() -> None:
    request = httpx.Request("POST", "http://agent/")
    refused = _client_error(httpx.ConnectError("refused", request=request))
    assert isinstance(failure_of(refused, streamed=False), Retryable)
    assert failure_of(refused, streamed=False).code == "agent_unreachable"
    after = failure_of(refused, streamed=True)
    assert not isinstance(after, Retryable) and after.code == "agent_stream_broken"
    assert isinstance(failure_of(A2AClientTimeoutError("slow"), streamed=False), Retryable)


@pytest.mark.parametrize("broken", [AnswerTooLarge, httpx.DecodingError])
def test_an_answer_too_large_or_undecodable_fails_at_once_as_the_http_protocols_does(
    broken: type[httpx.DecodingError],
) -> None:
    """An undecodable answer (a gzip that is not) is what ``AiohttpTransport`` raises
    ``DecodingError`` for."""
    request = httpx.Request("POST", "http://agent/")
    error = _client_error(broken("the agent's answer is broken", request=request))
    failure = failure_of(error, streamed=False)
    assert type(failure) is AgentFailure
    assert failure.code == "agent_protocol"


@pytest.mark.parametrize(("status", "retried"), [(503, True), (429, True), (400, False)])
def test_http_statuses_are_retried_as_the_http_protocol_retries_them(
    status: int, retried: bool
) -> None:
    request = httpx.Request("POST", "http://agent/")
    response = httpx.Response(status, request=request)
    error = _client_error(httpx.HTTPStatusError("x", request=request, response=response))
    failure = failure_of(error, streamed=False)
    assert isinstance(failure, Retryable) is retried
    assert failure.code == f"agent_http_{status}"


def test_errors_the_agent_answers_fail_at_once_with_their_reason() -> None:
    for error, code in [
        (InvalidParamsError("bad"), "a2a_invalid_params"),
        (TaskNotFoundError(), "a2a_task_not_found"),
    ]:
        failure = failure_of(error, streamed=False)
        assert type(failure) is AgentFailure
        assert failure.code == code
    assert failure_of(ValueError("odd"), streamed=False).code == "agent_protocol"


def _made_by_the_sdk(error: A2AError, status: int, url: str) -> A2AError:
    """An error as the SDK's REST transport makes one of an HTTP error answer with no message
    of its own (``_handle_http_error``): its text names the request's URL."""
    request = httpx.Request("POST", url)
    cause = httpx.HTTPStatusError("x", request=request, response=httpx.Response(status))
    try:
        raise error from cause
    except A2AError as exc:
        return exc


def test_an_error_the_sdk_wrote_with_the_agents_url_names_only_its_status() -> None:
    """ "Resource not found: http://10.1.2.3:8384/a2a/rest/message:send" went into the task's
    error, which its tenant reads (an audit, 2026-12-06)."""
    url = "http://10.1.2.3:8384/a2a/rest/message:send"
    failure = failure_of(
        _made_by_the_sdk(MethodNotFoundError(f"Resource not found: {url}"), 404, url),
        streamed=False,
    )
    assert (failure.code, failure.message) == ("a2a_method_not_found", "the agent answered 404")
    # The agent's own words, naming no address, are kept
    own = failure_of(_made_by_the_sdk(InvalidParamsError("no such city"), 400, url), streamed=False)
    assert own.message == "no such city"


class Traced:
    """What a call reads of its task's context: the trace its requests carry."""

    def trace_headers(self) -> dict[str, str]:
        return {"traceparent": f"00-{'a' * 32}-{'b' * 16}-01", "X-Trace-Id": "a" * 32}


class SilentAgent:
    """An A2A client whose agent accepts a message and never answers it."""

    def __init__(self) -> None:
        self.sent = 0

    async def send_message(self, request: Any, context: Any = None) -> Any:
        self.sent += 1
        await asyncio.sleep(3600)
        yield None  # pragma: no cover


def test_a_message_sent_for_an_answer_at_once_that_gets_none_is_retried() -> None:
    """A call of an agent that does not stream had no first-byte timeout: one accepted and
    never answered held its slot to the task's deadline, then ended ``expired``."""
    agent = SilentAgent()

    async def sent() -> Any:
        run = _Run(client=agent, ctx=Traced())  # type: ignore[arg-type]
        return await run.polled(SendMessageRequest(), first_byte_timeout_s=0.05)

    with pytest.raises(Retryable) as retried:
        asyncio.run(sent())
    assert (retried.value.code, agent.sent) == ("agent_timeout", 1)


class HangsOnceAgent:
    """An A2A client whose agent does not answer the first read of its task, then says it
    completed."""

    def __init__(self) -> None:
        self.reads = 0

    async def get_task(self, request: Any, context: Any = None) -> Task:
        self.reads += 1
        if self.reads == 1:
            await asyncio.sleep(3600)
        return Task(id=request.id, status=TaskStatus(state=TaskState.TASK_STATE_COMPLETED))


def test_a_read_of_the_agents_task_that_gets_no_answer_is_made_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(a2a_agent, "POLL_READ_S", 0.05)
    agent = HangsOnceAgent()

    async def polled() -> Any:
        run = _Run(client=agent, ctx=Traced(), task_id="t-1")  # type: ignore[arg-type]
        return await run.polled_from(0.01)

    assert asyncio.run(polled()) == {"text": "", "artifacts": []}
    assert agent.reads == 2


class BreaksAfterNamingAgent:
    """An A2A client whose agent names its task on a stream, which then breaks."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    async def send_message(self, request: Any, context: Any = None) -> Any:
        working = TaskStatus(state=TaskState.TASK_STATE_WORKING)
        yield StreamResponse(task=Task(id="remote-1", status=working))
        raise A2AClientError("the stream broke off")

    async def cancel_task(self, request: Any, context: Any = None) -> Task:
        self.cancelled.append(request.id)
        return Task(id=request.id)


class StreamingAgent:
    """``workers.bridge.a2a_agent.Agent`` as ``call`` uses it, for a client given."""

    first_byte_timeout_s = 5.0

    def __init__(self, client: Any, streams: bool = True) -> None:
        self._client, self._streams = client, streams

    async def client(self, transport: Any) -> tuple[Any, bool]:
        return self._client, self._streams

    def has_card(self) -> bool:
        return True

    def forget_card(self, client: Any) -> None:
        pass


def test_a_call_given_up_after_the_agent_named_its_task_cancels_that_task() -> None:
    """A retry sends a new message, a new task for the agent: the first ran on beside it."""
    agent = BreaksAfterNamingAgent()
    with pytest.raises(AgentFailure):
        asyncio.run(a2a_agent.call(StreamingAgent(agent), None, "book", ctx(), {"n": 1}))  # type: ignore[arg-type]
    assert agent.cancelled == ["remote-1"]


class NamesLateAgent:
    """An A2A client whose agent names its task ``named_after_s`` after the message came
    (never, if None), and records the tasks it was asked to cancel."""

    def __init__(self, named_after_s: float | None) -> None:
        self.named_after_s = named_after_s
        self.cancelled: list[str] = []

    async def send_message(self, request: Any, context: Any = None) -> Any:
        await asyncio.sleep(3600 if self.named_after_s is None else self.named_after_s)
        yield StreamResponse(task=Task(id="agent-task-1"))
        await asyncio.sleep(3600)

    async def cancel_task(self, request: Any, context: Any = None) -> None:
        self.cancelled.append(request.id)


@pytest.mark.parametrize("named_after_s", [0.2, None], ids=["named", "never"])
def test_a_cancel_before_the_agent_names_its_task_waits_a_while_for_it_to_cancel_it(
    monkeypatch: pytest.MonkeyPatch, named_after_s: float | None
) -> None:
    """A2A cancels a task, never a message: a call cancelled before the agent named its
    task sent no ``CancelTask``, and the agent worked on."""
    monkeypatch.setattr(a2a_agent, "CANCEL_TIMEOUT_S", 1.0)
    agent = NamesLateAgent(named_after_s)

    async def cancelled(streams: bool) -> None:
        served = StreamingAgent(agent, streams)
        call = asyncio.ensure_future(a2a_agent.call(served, None, "book", ctx(), {"n": 1}))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    for streams in (True, False):
        asyncio.run(cancelled(streams))
    assert agent.cancelled == ([] if named_after_s is None else ["agent-task-1"] * 2)
