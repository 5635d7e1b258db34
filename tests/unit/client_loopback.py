"""A scripted API on loopback for the client's own HTTP behaviour: ``tests.integration.
receiver.Receiver`` answering every method the client sends, a request's number (1-based) to
the reply; a script may hold its answer until ``released`` (a server that is still waiting)."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler
from typing import Any

from tests.integration.receiver import Receiver, Reply

TASK = {"task_id": "t1", "capability": "echo", "trace_id": "tr"}
HOLD_MOST_S = 30.0  # a held answer's longest hold: only bounds a test that went wrong


def task_reply(status: str, code: int = 200, **fields: Any) -> Reply:
    body = json.dumps({**TASK, "status": status, **fields}).encode()
    return Reply(code, {"Content-Type": "application/json"}, body)


def problem_reply(code: int, problem: str, **headers: str) -> Reply:
    body = json.dumps({"status": code, "code": problem, "detail": "d"}).encode()
    return Reply(code, {"Content-Type": "application/problem+json", **headers}, body)


def events_reply(*events: dict[str, Any]) -> Reply:
    frames = "".join(f"id: {e['seq']}\ndata: {json.dumps(e)}\n\n" for e in events)
    return Reply(200, {"Content-Type": "text/event-stream"}, frames.encode())


class Loopback(Receiver):
    """``with Loopback(script) as api: Reach(api.base_url, ...)``; ``api.requests`` holds
    what came and ``api.methods`` their methods; ``api.hold()`` is a reply that comes only
    once the test has ended (then the connection is dropped unanswered)."""

    def __init__(self, script: Any) -> None:
        self.methods: list[str] = []
        self.released = threading.Event()
        super().__init__(script)
        self.base_url = f"http://127.0.0.1:{self.port}"

    def hold(self) -> Reply:
        self.released.wait(HOLD_MOST_S)
        return Reply(drop=True)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        every = super()._handler()
        methods = self.methods

        class AnyMethod(every):
            def do_POST(self) -> None:
                methods.append(self.command)  # the client sends one request at a time
                super().do_POST()

            do_GET = do_PUT = do_PATCH = do_DELETE = do_POST

        return AnyMethod

    def __exit__(self, *exc: object) -> None:
        self.released.set()
        super().__exit__(*exc)


class DyingAPI:
    """An API that takes one request and dies before it answers: the connection ends
    unanswered and the port refuses every connection after it. ``with DyingAPI() as api:
    ... api.base_url ... api.received`` (the request's head, once it came)."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.received: list[bytes] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        connection, _ = self._listener.accept()
        with connection:
            connection.settimeout(HOLD_MOST_S)
            head = b""
            while b"\r\n\r\n" not in head:
                head += connection.recv(65536)
            self.received.append(head)
            self._listener.close()  # the port refuses from now on

    def header(self, name: str) -> str:
        """The value of header ``name`` in the request it took."""
        [head] = self.received
        lines = head.decode("latin-1").split("\r\n")[1:]
        [value] = [v.strip() for k, _, v in (h.partition(":") for h in lines) if k.lower() == name]
        return value

    def __enter__(self) -> DyingAPI:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._listener.close()
        self._thread.join(HOLD_MOST_S)
