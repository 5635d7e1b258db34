"""Real HTTP receivers on loopback for webhook tests: ``Receiver`` records every request and
answers as the test scripts it (a status, headers, or dropping the connection unanswered);
``Tarpit`` answers one byte at a time and never finishes."""

from __future__ import annotations

import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.eventually import eventually


@dataclass(frozen=True)
class Reply:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b"ok"
    drop: bool = False  # close the connection without an answer, as a dead server would


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]  # lowercase names
    body: bytes


Script = Callable[[int], Reply]  # request number (1-based) -> the reply


def always(reply: Reply) -> Script:
    return lambda _n: reply


ANSWER_OK = always(Reply())


class Receiver:
    """``with Receiver(script) as r: ... r.url ... r.requests``"""

    def __init__(
        self,
        script: Script = ANSWER_OK,
        host: str = "127.0.0.1",
        port: int = 0,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.script = script
        self.requests: list[Received] = []
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer((host, port), self._handler())
        self.server.daemon_threads = True
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.host = host
        self.port = int(self.server.server_address[1])
        self.url = f"{'https' if tls else 'http'}://{host}:{self.port}/hook"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                body = self.rfile.read(length)
                headers = {k.lower(): v for k, v in self.headers.items()}
                with receiver._lock:
                    receiver.requests.append(Received(self.path, headers, body))
                    number = len(receiver.requests)
                reply = receiver.script(number)
                if reply.drop:
                    self.close_connection = True
                    self.connection.close()
                    return
                self.send_response(reply.status)
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(reply.body)))
                self.end_headers()
                self.wfile.write(reply.body)

            do_GET = do_POST

            def log_message(self, *args: Any) -> None:
                pass

        return Handler

    def __enter__(self) -> Receiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def wait_for(self, count: int, timeout_s: float = 30) -> list[Received]:
        """The first ``count`` requests, once they have come; the timeout only bounds a hang."""
        eventually(lambda: len(self.requests), f"{count} requests", timeout_s, 0.02, count.__le__)
        return self.requests[:count]


@dataclass
class Held:
    """One connection a tarpit held: when it came, when it ended, and whether the client hung
    up while the tarpit still held it (not the tarpit letting go after ``hold_s``, or
    stopping)."""

    opened_at: float
    closed_at: float | None = None
    cut_by_client: bool = False


class Tarpit:
    """A raw socket server that answers every request with ``prefix`` and then one more byte
    every ``drip_s``, for ``hold_s`` at most: each read of the client gets a byte in time,
    so only a deadline on the whole attempt ends it.

    ``with Tarpit() as t: ... t.url ... t.held``"""

    def __init__(
        self,
        prefix: bytes = b"HTTP/1.1 200 OK\r\nX-Drip: ",
        drip_s: float = 0.2,
        hold_s: float = 120.0,
    ) -> None:
        self.prefix, self.drip_s, self.hold_s = prefix, drip_s, hold_s
        self.held: list[Held] = []
        self.most_open = 0  # the most connections held at one time
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.port = int(self._listener.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}/hook"

    @property
    def open_count(self) -> int:
        with self._lock:
            return sum(1 for h in self.held if h.closed_at is None)

    def wait_open(self, count: int, timeout_s: float = 30) -> None:
        """Until ``count`` connections are held at once; the timeout only bounds a hang."""
        eventually(
            lambda: self.open_count, f"{count} connections held", timeout_s, 0.02, count.__le__
        )

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._drip, args=(conn,), daemon=True).start()

    def _drip(self, conn: socket.socket) -> None:
        held = Held(time.monotonic())
        with self._lock:
            self.held.append(held)
            now_open = sum(1 for h in self.held if h.closed_at is None)
            self.most_open = max(self.most_open, now_open)
        try:
            conn.recv(65536)
            conn.sendall(self.prefix)
            until = time.monotonic() + self.hold_s
            while time.monotonic() < until and not self._stop.is_set():
                # Between drips, notice at once when the client hangs up (EOF or reset).
                readable, _, _ = select.select([conn], [], [], self.drip_s)
                if readable and not conn.recv(65536):
                    held.cut_by_client = True
                    break
                conn.sendall(b"x")
        except OSError:
            held.cut_by_client = True  # the client hung up (a reset): what a deadline does
        finally:
            with self._lock:
                held.closed_at = time.monotonic()
            conn.close()

    def __enter__(self) -> Tarpit:
        threading.Thread(target=self._serve, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._listener.close()
