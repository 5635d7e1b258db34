"""A submit that waits (``sync``) or streams holds none of its payload while it does.

A payload of 1 MiB of JSON parses into some 20 MiB of Python objects (a million empty
lists), and a tenant may hold hundreds of waits and streams open for minutes: held, they
were gigabytes of one API process's memory. The API runs in this process (``ServedApp``),
so what it holds is counted here: the payload's empty lists, while the wait or the stream
is open."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator

import httpx
import pytest
from sqlalchemy import Engine

from api.app import create_app
from broker.registry import leases
from broker.registry.model import Card
from broker.settings import Settings
from tests.eventually import eventually
from tests.integration.conftest import KeyMaker, client_for, count_tasks
from tests.integration.stack import CeleryProcess, ServedApp
from tests.integration.test_a2a_facade import A2A_VERSION

CAPABILITY = "test.nobody-holds"  # its card is advertised here; no agent ever serves it
PAD = 20_000  # 60 KB of JSON: within the tests' 64 KiB payload limit


def empty_lists() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is list and not o)


def envelope(reply_mode: str) -> bytes:
    """Built as text, so this test holds no list of its own."""
    pad = b",".join([b"[]"] * PAD)
    return (
        b'{"capability": "%s", "reply_mode": "%s", "queue_if_unavailable": true,'
        b' "deadline_ms": 5000, "payload": {"text": "a", "pad": [%s]}}'
        % (CAPABILITY.encode(), reply_mode.encode(), pad)
    )


@pytest.fixture(scope="module")
def api(engine: Engine, settings: Settings) -> Iterator[ServedApp]:
    card = Card.declare(CAPABILITY, agent_id="test-holds", version="1.0.0")
    leases.advertise_cards(engine, [card.document()])
    with ServedApp(create_app(settings)) as served:
        yield served


def held_while_waiting(
    engine: Engine, tenant: str, post: Callable[[], httpx.Response]
) -> tuple[int, httpx.Response]:
    """The empty lists more than before that this process holds once ``post`` (sent in a
    thread) has its task accepted and waits for its answer, while it still waits; and the
    answer. The submit goes on a moment after its row is in (its message, its queued event),
    holding its payload until then: the lists are counted until they are let go, and must be
    while the wait lasts (seconds), not only once it ends."""
    answers: list[httpx.Response] = []
    before = empty_lists()
    waiting = threading.Thread(target=lambda: answers.append(post()))
    waiting.start()
    try:
        eventually(
            lambda: count_tasks(engine, tenant) == 1 or not waiting.is_alive(),
            "the task to be accepted",
        )
        held = eventually(
            lambda: empty_lists() - before,
            "the payload's lists to be let go",
            until=lambda held: held < PAD // 10 or not waiting.is_alive(),
        )
        assert waiting.is_alive(), f"the wait ended before its payload was let go: {answers}"
    finally:
        waiting.join()
    return held, answers[0]


def held_while_streaming(
    http: httpx.Client, path: str, body: bytes, headers: dict[str, str]
) -> int:
    """The empty lists more than before that this process holds while the stream ``body``
    opened at ``path`` is open, past its first event."""
    before = empty_lists()
    with http.stream("POST", path, content=body, headers=headers) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        while not next(lines).startswith("data:"):
            pass
        return empty_lists() - before


def test_a_sync_wait_holds_none_of_its_payload(
    api: ServedApp, engine: Engine, make_key: KeyMaker
) -> None:
    tenant, token = make_key()
    body = envelope("sync")
    headers = {"Content-Type": "application/json"}
    with client_for(api, token) as http:
        # When its task is accepted and its submit waits for it (5 s: the deadline)
        held, answer = held_while_waiting(
            engine, tenant, lambda: http.post("/tasks", content=body, headers=headers)
        )
    # Then the waiting submit held none of the payload's lists
    assert held < PAD // 10, f"{held} of the payload's {PAD} lists held by a sync wait"
    # and answered as a wait that outlived it does: still queued (202), or expired (200) when
    # a sweeper passed its deadline first (none serves the capability)
    assert (answer.status_code, answer.json()["status"]) in {(202, "queued"), (200, "expired")}, (
        answer.text
    )


def test_a_stream_holds_none_of_its_payload(
    api: ServedApp, engine: Engine, make_key: KeyMaker
) -> None:
    tenant, token = make_key()
    body = envelope("stream")
    with client_for(api, token) as http:
        # When its stream is open
        held = held_while_streaming(http, "/tasks", body, {"Content-Type": "application/json"})
        assert count_tasks(engine, tenant) == 1
    # Then it held none of the payload's lists
    assert held < PAD // 10, f"{held} of the payload's {PAD} lists held by a stream"


def test_an_a2a_stream_holds_none_of_its_data_part(
    api: ServedApp, engine: Engine, make_key: KeyMaker, worker: CeleryProcess
) -> None:
    """The part is taken out of the request before the SDK parses it (``api.a2a``), and the
    request lasts as long as its stream."""
    tenant, token = make_key()
    pad = b",".join([b"[]"] * PAD)
    data = b'{"text": "A b. C d. E f.", "max_sentences": 3, "delay_s": 1, "pad": [%s]}' % pad
    body = (
        b'{"jsonrpc": "2.0", "id": 1, "method": "SendStreamingMessage", "params": {"message":'
        b' {"messageId": "held-1", "role": "ROLE_USER", "parts": [{"data": %s}],'
        b' "metadata": {"capability": "text.summarize"}}}}' % data
    )
    headers = {"Content-Type": "application/json", **A2A_VERSION}
    with client_for(api, token) as http:
        # When its stream is open, the task running for seconds
        held = held_while_streaming(http, "/a2a/jsonrpc", body, headers)
        assert count_tasks(engine, tenant) == 1
    # Then it held none of the part's lists
    assert held < PAD // 10, f"{held} of the part's {PAD} lists held by an A2A stream"


def test_an_mcp_tool_call_holds_none_of_its_arguments(
    api: ServedApp, engine: Engine, make_key: KeyMaker, worker: CeleryProcess
) -> None:
    """The arguments are taken out of the body before the SDK parses it (its parse lives as
    long as the call: ``api.mcp.route.lift_arguments``), and let go once the task is in."""
    tenant, token = make_key()
    pad = b",".join([b"[]"] * PAD)
    arguments = b'{"text": "A b. C d. E f.", "max_sentences": 3, "delay_s": 2, "pad": [%s]}' % pad
    body = (
        b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call",'
        b' "params": {"name": "text.summarize", "arguments": %s}}' % arguments
    )
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    with client_for(api, token) as http:
        # When its task is accepted and the call waits for it (4 s: two pauses of 2 s)
        held, answer = held_while_waiting(
            engine, tenant, lambda: http.post("/mcp", content=body, headers=headers)
        )
    # Then the call held none of the arguments' lists, and the tool ran on them
    assert held < PAD // 10, f"{held} of the arguments' {PAD} lists held by an MCP call"
    assert answer.status_code == 200, answer.text
    assert '"isError":false' in answer.text.replace(" ", ""), answer.text[:2000]
