"""A real HTTP receiver on loopback for webhook tests: it records every request and answers
as the test scripts it (a status, headers, or dropping the connection unanswered)."""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


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
        deadline = time.monotonic() + timeout_s
        while len(self.requests) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(self.requests)} of {count} requests came")
            time.sleep(0.02)
        return self.requests[:count]
