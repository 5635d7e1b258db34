"""A request's head (its line and headers) is bounded before any key is checked
(``api.connections.Protocol``): httptools held any head whole until it ended.

Given the API on a real port and raw sockets, when a client sends a head past 64 KiB, or one
that does not arrive in time, I expect a problem+json answer and the end of its connection;
heads of a normal size, the requests after them on one connection, and a large body pass.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from contextlib import closing

import pytest

from api import connections
from api.app import create_app
from broker.settings import Settings
from tests.integration.conftest import KeyMaker
from tests.integration.stack import ServedApp

KIB = 1024


def _connected(api: ServedApp) -> socket.socket:
    # The timeout bounds a hang only: every read below waits for a fact, not a duration.
    return socket.create_connection(("127.0.0.1", api.port), timeout=30)


def _until_closed(sock: socket.socket) -> bytes:
    """Everything the API sends until it ends the connection."""
    received = bytearray()
    while chunk := sock.recv(65536):
        received += chunk
    return bytes(received)


def _one_answer(sock: socket.socket) -> tuple[int, bytes]:
    """The status and body of the next answer on a connection that stays open."""
    received = bytearray()
    while b"\r\n\r\n" not in received:
        received += _more(sock)
    head, _, body = bytes(received).partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += _more(sock)
    return int(head.split(b" ")[1]), body


def _more(sock: socket.socket) -> bytes:
    chunk = sock.recv(65536)
    assert chunk, "the API closed the connection"
    return chunk


def _problem(answer: bytes) -> tuple[int, dict[str, object]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/problem+json" in head.lower(), head
    return int(head.split(b" ")[1]), json.loads(body)


@pytest.mark.parametrize("ending", ["whole", "never ends"])
def test_a_head_past_64_kib_is_431_and_its_connection_ends(api: ServedApp, ending: str) -> None:
    """Before, a 16 MiB ``traceparent`` was answered 200, and a head that never ended was held
    for as long as its connection stayed open: no key is needed to send one."""
    # Given a connection without a key
    with closing(_connected(api)) as sock:
        # When its request's head passes 100 KiB (ended, or never ended)
        head = b"GET /healthz HTTP/1.1\r\nHost: x\r\ntraceparent: " + b"a" * (100 * KIB)
        sock.sendall(head + (b"\r\n\r\n" if ending == "whole" else b""))
        # Then it is answered 431 problem+json, and the API ends the connection
        status, problem = _problem(_until_closed(sock))
    assert status == 431
    assert problem["code"] == "headers_too_large"
    assert problem["status"] == 431


def test_heads_of_8_kib_a_large_body_and_the_requests_after_them_pass_on_one_connection(
    settings: Settings, make_key: KeyMaker
) -> None:
    # Given a connection of a tenant, to an API that takes payloads of up to 1 MiB
    _, token = make_key()
    padding = "".join(f"X-Padding-{n}: {'p' * KIB}\r\n" for n in range(8))
    listing = (
        f"GET /tasks?limit=1 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n{padding}\r\n"
    ).encode()
    body = json.dumps(
        {
            "capability": "test.nobody",
            "payload": {"text": "x" * (512 * KIB)},
            "queue_if_unavailable": True,
        }
    ).encode()
    submit = (
        f"POST /tasks HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    large = settings.model_copy(update={"max_payload_bytes": 1024 * KIB})
    with ServedApp(create_app(large)) as api, closing(_connected(api)) as sock:
        # When it sends ten requests with 8 KiB of headers each (80 KiB of heads in all)
        statuses = []
        for _ in range(10):
            sock.sendall(listing)
            statuses.append(_one_answer(sock)[0])
        # and a submit with a 512 KiB body, and one more request
        sock.sendall(submit + body)
        submitted, _ = _one_answer(sock)
        sock.sendall(listing)
        after, _ = _one_answer(sock)
    # Then each is answered as it always was
    assert statuses == [200] * 10
    assert submitted == 202
    assert after == 200


@pytest.fixture
def head_timeout_s(monkeypatch: pytest.MonkeyPatch) -> Iterator[float]:
    """A head deadline of a second for the API in this process, so a test need not wait 10 s
    (``connections.HEAD_TIMEOUT_S`` is read as each deadline is set)."""
    monkeypatch.setattr(connections, "HEAD_TIMEOUT_S", 1.0)
    yield 1.0


def test_a_head_not_whole_in_time_is_408_and_its_connection_ends(
    api: ServedApp, head_timeout_s: float
) -> None:
    """Before, a head sent a byte at a time, or a part of one, held its connection for as
    long as the client liked (the doc said: put a proxy with a header timeout in front)."""
    # Given a connection that sends part of a head, then nothing more
    with closing(_connected(api)) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        # Then once the deadline has passed it is answered 408, and the connection ends
        status, problem = _problem(_until_closed(sock))
    assert status == 408
    assert problem["code"] == "head_timeout"


def test_a_connection_that_sends_nothing_is_closed_unanswered(
    api: ServedApp, head_timeout_s: float
) -> None:
    # Given a connection that sends nothing
    with closing(_connected(api)) as sock:
        # Then once the deadline has passed the API closes it, with nothing to answer
        assert _until_closed(sock) == b""
