"""``bench.loadgen.Caller``, the client of the benchmark's round trips, against a loopback
server that closes its keep-alive connections as uvicorn does when they sit idle."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import pytest

from bench.loadgen import Caller

ACCEPT_WITHIN_S = 1.0
ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n"


def serve(listener: socket.socket, answers: list[bytes], seen: list[int]) -> None:
    """Each connection gets the next of ``answers`` to its first request, then is closed;
    ``seen`` collects the number of each connection that sent a request. Ends when no
    connection comes within the listener's timeout."""
    for number, answer in enumerate(answers):
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            return
        with conn:
            if conn.recv(65536):
                seen.append(number)
                conn.sendall(answer)


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        sock.settimeout(ACCEPT_WITHIN_S)
        yield sock


def test_a_connection_closed_after_its_answer_is_opened_again_for_the_next_call(
    listener: socket.socket,
) -> None:
    seen: list[int] = []
    answers = [ANSWER + b'{"call": 1}', ANSWER + b'{"call": 2}']
    server = threading.Thread(target=serve, args=(listener, answers, seen), daemon=True)
    server.start()
    with Caller(listener.getsockname()[1], "token") as caller:
        first = caller.post("/tasks", {})
        second = caller.post("/tasks", {})
    server.join(timeout=10)
    assert not server.is_alive()
    assert (first.json(), second.json()) == ({"call": 1}, {"call": 2})
    assert seen == [0, 1]


def test_an_answer_broken_off_is_an_error_not_sent_again(listener: socket.socket) -> None:
    seen: list[int] = []
    answers = [ANSWER + b'{"ca', ANSWER + b'{"call": 2}']
    server = threading.Thread(target=serve, args=(listener, answers, seen), daemon=True)
    server.start()
    with (
        Caller(listener.getsockname()[1], "token") as caller,
        pytest.raises(asyncio.IncompleteReadError),
    ):
        caller.post("/tasks", {})
    server.join(timeout=10)
    assert not server.is_alive()
    assert seen == [0]
