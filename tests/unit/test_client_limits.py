"""A hostile or broken server cannot make the client grow without end: an answer, a line of
an event stream and an event are each read up to ``MAX_ANSWER_BYTES``, then given up with
``APIConnectionError``. The server is real, on loopback, and never ends its answer."""

from __future__ import annotations

import asyncio
import socket
import threading
import tracemalloc
from collections.abc import Callable

import pytest
from reach_client import AsyncReach, Reach
from reach_client.errors import APIConnectionError
from reach_client.limits import MAX_ANSWER_BYTES

PIECE = 64 * 1024
HEADROOM = 8 * 1024 * 1024  # what httpx and the test's own objects hold besides the answer


class Flood:
    """Answers each request with ``head``, then ``unit`` over and over until the client
    hangs up; ``most`` bytes bounds it for the test alone (an unbounded client would read
    them all). ``sent`` counts what went out, ``requests`` the requests."""

    def __init__(self, head: bytes, unit: bytes, most: int = 3 * MAX_ANSWER_BYTES) -> None:
        self.head, self.most, self.sent, self.requests = head, most, 0, 0
        self.piece = unit * max(PIECE // len(unit), 1)
        self.hung_up = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed: the test is over
                return
            self.requests += 1
            self._flood(conn)

    def _flood(self, conn: socket.socket) -> None:
        with conn:
            conn.recv(65536)  # the request: one GET, its headers only
            try:
                conn.sendall(self.head)
                while self.sent < self.most:
                    conn.sendall(self.piece)
                    self.sent += len(self.piece)
            except OSError:
                self.hung_up.set()

    def __enter__(self) -> Flood:
        threading.Thread(target=self._serve, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._listener.close()


def get_sync(url: str) -> object:
    with Reach(url, "rk_test", max_retries=0) as reach:
        return reach.tasks.get("t1")


def get_async(url: str) -> object:
    async def get() -> object:
        async with AsyncReach(url, "rk_test", max_retries=0) as reach:
            return await reach.tasks.get("t1")

    return asyncio.run(get())


def stream_sync(url: str) -> object:
    with Reach(url, "rk_test", max_retries=0) as reach:
        return list(reach.tasks.stream("t1"))


def stream_async(url: str) -> object:
    async def stream() -> object:
        async with AsyncReach(url, "rk_test", max_retries=0) as reach:
            return [event async for event in reach.tasks.stream("t1")]

    return asyncio.run(stream())


def given_up(call: Callable[[str], object], flood: Flood) -> tuple[APIConnectionError, int]:
    """The error ``call`` gave up with against ``flood``, and the most memory it held."""
    tracemalloc.start()
    try:
        with flood, pytest.raises(APIConnectionError) as raised:
            call(flood.url)
        return raised.value, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def assert_cut_off(call: Callable[[str], object], flood: Flood) -> None:
    error, peak = given_up(call, flood)
    assert error.code == "answer_too_large", error
    assert peak < MAX_ANSWER_BYTES + HEADROOM, f"held {peak / 2**20:.0f} MiB"
    assert flood.hung_up.wait(10) and flood.sent < flood.most  # the client stopped reading


JSON_200 = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n"
EVENTS_200 = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
PROBLEM_500 = b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n\r\n"


@pytest.mark.parametrize("call", [get_sync, get_async], ids=["sync", "async"])
@pytest.mark.parametrize("head", [JSON_200, PROBLEM_500], ids=["an answer", "an error's problem"])
def test_an_answer_that_never_ends_is_given_up_at_the_cap(
    call: Callable[[str], object], head: bytes
) -> None:
    assert_cut_off(call, Flood(head, b"a"))


@pytest.mark.parametrize("call", [stream_sync, stream_async], ids=["sync", "async"])
@pytest.mark.parametrize(
    ("head", "unit"),
    [
        (EVENTS_200 + b"data: ", b"a"),  # one line that never ends
        (EVENTS_200, b"data: " + b"a" * 1000 + b"\n"),  # one event that never ends
        (PROBLEM_500, b"a"),  # the stream refused with a problem that never ends
    ],
    ids=["a line", "an event", "a refusal"],
)
def test_an_event_stream_that_never_ends_a_line_or_an_event_is_given_up_at_the_cap(
    call: Callable[[str], object], head: bytes, unit: bytes
) -> None:
    assert_cut_off(call, Flood(head, unit))


def test_an_answer_past_the_cap_is_not_asked_for_again() -> None:
    """The same request would be as large: retries (two by default) would each read the cap."""
    flood = Flood(JSON_200, b"a")
    with flood, Reach(flood.url, "rk_test") as reach, pytest.raises(APIConnectionError) as raised:
        reach.tasks.get("t1")

    assert raised.value.code == "answer_too_large"
    assert flood.requests == 1


SMALL_CAP = 2**20


@pytest.mark.parametrize("read", ["answer", "stream"])
@pytest.mark.parametrize("client", ["sync", "async"])
def test_a_client_given_a_smaller_cap_gives_up_there(read: str, client: str) -> None:
    head, unit = (JSON_200, b"a") if read == "answer" else (EVENTS_200 + b"data: ", b"a")
    flood = Flood(head, unit)

    async def in_async() -> object:
        async with AsyncReach(flood.url, "rk_test", max_retries=0, max_answer_bytes=SMALL_CAP) as r:
            if read == "answer":
                return await r.tasks.get("t1")
            return [event async for event in r.tasks.stream("t1")]

    def in_sync() -> object:
        with Reach(flood.url, "rk_test", max_retries=0, max_answer_bytes=SMALL_CAP) as r:
            return r.tasks.get("t1") if read == "answer" else list(r.tasks.stream("t1"))

    def call(_: str) -> object:
        return asyncio.run(in_async()) if client == "async" else in_sync()

    error, peak = given_up(call, flood)
    assert error.code == "answer_too_large"
    assert str(SMALL_CAP) in str(error)  # its own cap, not the default's
    assert peak < SMALL_CAP + HEADROOM, f"held {peak / 2**20:.0f} MiB"
    assert flood.hung_up.wait(10)  # the client stopped reading


@pytest.mark.parametrize("client", ["sync", "async"])
def test_a_client_given_a_larger_cap_reads_an_answer_past_the_default_whole(client: str) -> None:
    """A server configured for results near the default cap (``REACH_MAX_RESULT_BYTES``):
    its answers reach a client that raised its own cap to match."""
    result = "r" * (MAX_ANSWER_BYTES + 1024)
    body = (
        b'{"task_id": "t1", "capability": "c", "status": "succeeded", "trace_id": "x", "result": "'
        + result.encode()
        + b'"}'
    )
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
    answer = head + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    cap = 2 * MAX_ANSWER_BYTES

    async def in_async() -> object:
        async with AsyncReach(server.url, "rk_test", max_retries=0, max_answer_bytes=cap) as r:
            return await r.tasks.get("t1")

    def in_sync() -> object:
        with Reach(server.url, "rk_test", max_retries=0, max_answer_bytes=cap) as r:
            return r.tasks.get("t1")

    with Flood(answer, b" ", most=0) as server:  # the answer whole, then the end
        task = asyncio.run(in_async()) if client == "async" else in_sync()

    assert task.result == result  # type: ignore[attr-defined]


def test_a_cap_below_one_byte_is_refused() -> None:
    with pytest.raises(ValueError, match="max_answer_bytes"):
        Reach("http://127.0.0.1:9", "rk_test", max_answer_bytes=0)
