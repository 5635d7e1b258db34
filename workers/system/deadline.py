"""An httpcore network backend whose every socket operation ends by one deadline.

httpx and httpcore time each operation (connect, one read, one write) on its own, so a receiver
that sends its headers one byte every few seconds is never timed out. Here each operation
gets only what is left until the deadline, and a write is sent piece by piece under the same
rule, so an attempt (connect, TLS, request, headers and body) ends by the deadline whatever
the other side does.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Iterable
from typing import Any

import httpcore


class Deadline:
    """A point on the monotonic clock; ``left`` is what an operation may still take."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def left(self, timeout: float | None, expired: type[Exception]) -> float:
        remaining = self.at - time.monotonic()
        if remaining <= 0:
            raise expired("the attempt's deadline has passed")
        return remaining if timeout is None else min(timeout, remaining)

    @property
    def passed(self) -> bool:
        return time.monotonic() >= self.at


class DeadlineStream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream, deadline: Deadline) -> None:
        self._inner = inner
        self._deadline = deadline

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        # One recv (plain or TLS) bounded by what is left: a dribbler gains nothing per byte.
        return self._inner.read(max_bytes, self._deadline.left(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        # Not the inner write: it repeats send() with the same timeout until all is sent,
        # so a receiver reading a byte at a time could stretch it without end.
        sock: socket.socket = self._inner.get_extra_info("socket")
        view = memoryview(buffer)
        while view:
            sock.settimeout(self._deadline.left(timeout, httpcore.WriteTimeout))
            try:
                sent = sock.send(view)
            except TimeoutError as exc:
                raise httpcore.WriteTimeout(str(exc)) from exc
            except OSError as exc:
                raise httpcore.WriteError(str(exc)) from exc
            view = view[sent:]

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        # The handshake is one operation under one socket timeout (CPython's ssl keeps a
        # deadline across its reads), so it too ends by the deadline.
        left = self._deadline.left(timeout, httpcore.ConnectTimeout)
        inner = self._inner.start_tls(ssl_context, server_hostname, left)
        return DeadlineStream(inner, self._deadline)

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class DeadlineBackend(httpcore.NetworkBackend):
    """The standard sync backend, with every stream held to ``deadline``."""

    def __init__(self, deadline: Deadline) -> None:
        self._deadline = deadline
        self._backend = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        left = self._deadline.left(timeout, httpcore.ConnectTimeout)
        stream = self._backend.connect_tcp(host, port, left, local_address, socket_options)
        return DeadlineStream(stream, self._deadline)

    def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        raise httpcore.ConnectError("webhooks connect over TCP only")

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)
