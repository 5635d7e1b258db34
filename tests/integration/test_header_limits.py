"""A request's head (its line and headers) is bounded before any key is checked
(``api.connections.Protocol``): httptools held any head whole until it ended.

Given the API on a real port and raw sockets, when a client sends a head past 64 KiB, or one
that does not arrive in time, I expect a problem+json answer and the end of its connection;
heads of a normal size, the requests after them on one connection, and a large body pass.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import httpx
import psutil
import pytest

from api import connections
from api.app import create_app
from broker.settings import Settings
from tests.eventually import eventually
from tests.integration.conftest import KeyMaker
from tests.integration.stack import ROOT, ServedApp, environment, free_port

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


MALFORMED = {
    "a control character in a header": b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: a\x01b\r\n\r\n",
    "a negative Content-Length": b"POST /tasks HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    "a bad chunk size": (
        b"POST /tasks HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"
    ),
    "a space before a colon": b"GET /healthz HTTP/1.1\r\nHost : x\r\n\r\n",
    "an unknown version": b"GET /healthz HTTP/7.3\r\nHost: x\r\n\r\n",
    "a NUL in the path": b"GET /heal\x00thz HTTP/1.1\r\nHost: x\r\n\r\n",
    "a method that is no token": b"G(T /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
}


@pytest.mark.parametrize("request_bytes", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_request_the_parser_cannot_read_is_400_problem_json_and_its_connection_ends(
    api: ServedApp, request_bytes: bytes
) -> None:
    """uvicorn answered these itself, in text/plain and without the headers every answer
    carries (an audit, 2026-12-06)."""
    with closing(_connected(api)) as sock:
        sock.sendall(request_bytes)
        answer = _until_closed(sock)
    status, problem = _problem(answer)
    assert (status, problem["code"]) == (400, "invalid_http")
    head = answer.partition(b"\r\n\r\n")[0].lower()
    assert b"x-content-type-options: nosniff" in head
    assert b"content-security-policy: default-src 'none'" in head


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


def test_a_head_begun_after_the_connection_waited_has_its_own_deadline(
    api: ServedApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, the first request's deadline counted from the connection's start: a client
    that opened its connection ahead of its request was answered 408 for a head that took
    less than the deadline. The durations below are the client's pace, not a bound on the API."""
    deadline_s = 3.0
    monkeypatch.setattr(connections, "HEAD_TIMEOUT_S", deadline_s)
    # Given a connection that waits nine tenths of the deadline before its request
    with closing(_connected(api)) as sock:
        time.sleep(0.9 * deadline_s)
        # When its head comes in two parts, the second past the connection's deadline but
        # well within the head's own (2.4 s to spare for a paused test process)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        time.sleep(0.2 * deadline_s)
        sock.sendall(b"X-Late: yes\r\n\r\n")
        # Then it is answered as usual
        status, _ = _one_answer(sock)
    assert status == 200


# The API process of the test below: uvicorn's command line as deployed, run with the head's
# deadline shortened (argv[1]) so the test need not wait 10 s.
SERVE_WITH_DEADLINE = (
    "import sys; from api import connections; "
    "connections.HEAD_TIMEOUT_S = float(sys.argv.pop(1)); "
    "from uvicorn.main import main; main()"
)


STALLED_DEADLINE_S = 2.0


@pytest.fixture
def api_process(settings: Settings, log_dir: Path) -> Iterator[tuple[int, int]]:
    """``uvicorn ... --loop uvloop --http api.connections:Protocol`` in a process of its own
    (one the test can stop), with a head deadline of ``STALLED_DEADLINE_S``: its port and pid."""
    port = free_port()
    argv = [sys.executable, "-c", SERVE_WITH_DEADLINE, str(STALLED_DEADLINE_S)]
    argv += ["api.app:create_app_from_env", "--factory", "--loop", "uvloop"]
    argv += ["--http", "api.connections:Protocol", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--log-level", "warning"]
    log_path = log_dir / f"stalled-api-{port}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv, env=environment(settings), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        eventually(
            lambda: _healthy(port) or process.poll() is not None, "the API to start or exit", 90
        )
        assert process.poll() is None, log_path.read_text(errors="replace")
        yield port, process.pid
    finally:
        os.kill(process.pid, signal.SIGCONT)  # should the test have ended it stopped
        process.terminate()
        process.wait(timeout=30)


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _unread_by_server(port: int, client_port: int) -> int | None:
    """The bytes the kernel holds for the API from this client's connection, unread
    (``/proc/net/tcp``'s rx_queue): None until the connection shows there."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, queues = fields[1], fields[2], fields[4]
        if int(local.split(":")[1], 16) == port and int(remote.split(":")[1], 16) == client_port:
            return int(queues.split(":")[1], 16)
    return None


def _stop_while_polling(pid: int) -> None:
    """SIGSTOP the process while its loop waits in epoll for something to do. Stopped in a
    callback instead, the loop would poll (and read) as it goes on, before it ran its timers:
    that stall shows nothing. ``/proc/<pid>/syscall`` names the call a process is stopped in."""
    api = psutil.Process(pid)

    def stopped_in_poll() -> bool:
        if Path(f"/proc/{pid}/wchan").read_text() != "do_epoll_wait":
            return False
        polling = Path(f"/proc/{pid}/syscall").read_text().split()[0]
        os.kill(pid, signal.SIGSTOP)
        eventually(lambda: api.status() == psutil.STATUS_STOPPED, "the API to stop", 10, 0.01)
        if Path(f"/proc/{pid}/syscall").read_text().split()[0] == polling:
            return True
        os.kill(pid, signal.SIGCONT)
        return False

    eventually(stopped_in_poll, "the API stopped while its loop polls", 10, 0.01)


def test_a_head_that_arrived_in_time_is_answered_after_the_loop_stalls_past_its_deadline(
    api_process: tuple[int, int],
) -> None:
    """uvloop runs the timers that are due before it reads what a poll found: after a stall
    of the API's loop (a long callback, a GC or VM pause; SIGSTOP here) longer than the
    deadline, the head's deadline fired before the loop read the rest of the head, waiting
    in the kernel since well before the deadline, and a request sent in time was 408."""
    port, pid = api_process
    # Given a connection whose head has begun and been read, the API waiting for more
    with closing(socket.create_connection(("127.0.0.1", port), timeout=30)) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\n")
        client_port = sock.getsockname()[1]
        eventually(lambda: _unread_by_server(port, client_port) == 0, "the API to read it")
        # When the API's loop stalls, the rest of the head arrives at once, and the stall
        # lasts past the head's deadline
        _stop_while_polling(pid)
        try:
            sock.sendall(b"Host: x\r\n\r\n")
            time.sleep(2 * STALLED_DEADLINE_S)
        finally:
            os.kill(pid, signal.SIGCONT)
        # Then the request is answered, not refused
        status, _ = _one_answer(sock)
    assert status == 200
