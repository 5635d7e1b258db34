"""The HTTP protocol the API is served with: ``uvicorn ... --http api.connections:Protocol``.

uvicorn's own protocol (httptools', or h11's where httptools is not installed), with two
bounds on what a client that stops reading can hold:

- Each connection's kernel send buffer is bounded to ``SEND_BUFFER_BYTES`` (the kernel
  doubles it for its bookkeeping). Left to autotuning, the kernel holds up to
  ``net.ipv4.tcp_wmem``'s maximum for such a client (4 MiB by default): a tenant's 1,000 open
  streams (``REACH_MAX_STREAMS_PER_TENANT``) that read nothing held about 3.7 GB of one API
  process's memory. 128 KiB carries a page of any listing (1 MiB at most) in a few turns of
  the loop, and loopback and LAN round trips fill it many times a second; a client a long
  way off reads a large answer at up to this much per round trip.
- A connection whose client acknowledges less than ``MIN_TAKEN_BYTES`` of what waits for it
  in ``REACH_CLIENT_STALL_S`` is reset (``Stall``). Past the kernel's buffer, an answer waits
  in the process, and nothing else ends it: uvicorn closes a connection by flushing it first,
  and a client whose receive window stays shut never lets that happen. One tenant's requests
  for a 1 MiB page from sockets that read nothing each held the page and a file descriptor
  for as long as they stayed open, at the request rate's 1,000 a second: no stream slot and
  no waiting slot counts a plain answer once it has started.
- A request's head (its line and headers) past ``HEAD_MAX_BYTES`` is answered 431
  ``headers_too_large``, and one not whole within ``HEAD_TIMEOUT_S`` of its first byte 408
  ``head_timeout`` (a connection that sends no byte within ``HEAD_TIMEOUT_S`` of its start
  is closed unanswered). httptools holds a head in
  memory until it ends, with no bound of its own, before any key is checked: one 16 MiB
  ``traceparent`` was answered 200, and ten connections each sending 16 MiB of a header they
  never finished took an API process from 181 to 353 MiB for as long as they stayed open.
  After either answer the connection is half-closed: what the client still sends is read and
  dropped for up to ``LINGER_S`` (closing with bytes unread would reset the connection and
  could take the answer with it), then the connection is reset.

h11 (the fallback) refuses a head past 16 KiB itself (400); the head bounds here are
httptools' only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import struct
from http import HTTPStatus
from typing import Any

from api.errors import PROBLEM_JSON
from api.middleware import DATA_CSP

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _Uvicorns

    HEADS_BOUNDED_HERE = True
except ImportError:  # pragma: no cover - no httptools (PyPy, some platforms): uvicorn's other
    from uvicorn.protocols.http.h11_impl import H11Protocol as _Uvicorns  # type: ignore[assignment]

    HEADS_BOUNDED_HERE = False

try:
    import fcntl
    import termios
except ImportError:  # pragma: no cover - not a Unix: the kernel's share is not counted
    fcntl = termios = None  # type: ignore[assignment]

SEND_BUFFER_BYTES = 128 * 1024
MIN_TAKEN_BYTES = 16 * 1024  # in each REACH_CLIENT_STALL_S while bytes wait: about 0.5 KiB/s
STALL_KEY = "reach.client_stall_s"  # the lifespan state's entry (``api.app``)
DEFAULT_STALL_S = 30.0
HEAD_MAX_BYTES = 64 * 1024
# From a request's first byte to its last header, and from the connection's start to its first
# byte. A real client's head comes in its first packet or two; a body has
# REACH_BODY_READ_TIMEOUT_S (10 s) too.
HEAD_TIMEOUT_S = 10.0
# A head's deadline, once passed, is judged this much later, after the loop has read what
# waits: see ``Protocol._head_late``.
READ_FIRST_S = 0.5
LINGER_S = 5.0
TOO_LARGE = f"the request's line and headers are over {HEAD_MAX_BYTES} bytes"
log = logging.getLogger("reach.api")


class Protocol(_Uvicorns):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        bound_send_buffer(transport)
        counted = Counted(transport)
        self._stall = Stall(
            counted, self.loop, float(self.app_state.get(STALL_KEY, DEFAULT_STALL_S))
        )
        # From a request's last byte (or the connection's start) to the next one's last
        # header the parser is in a head, and holds what it has of it.
        self._in_head = True
        self._crossings = 0  # heads and bodies the parser has finished
        self._head_fed = 0  # bytes of reads that fell wholly in the current head
        self._head_begun = False  # a byte of the current head has come
        self._refused = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_read_up = False  # the deadline has passed, and what waited is being read
        self._linger: asyncio.TimerHandle | None = None
        if HEADS_BOUNDED_HERE:
            self._start_head_timer()  # for the first byte
        super().connection_made(counted)  # type: ignore[arg-type]

    def connection_lost(self, exc: Exception | None) -> None:
        self._stall.stop()
        self._stop_head_timer()
        if self._linger is not None:
            self._linger.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # read and dropped: the answer is sent, the connection lingers
        in_head, crossings = self._in_head, self._crossings
        super().data_received(data)
        if not HEADS_BOUNDED_HERE or self._refused:
            return
        if in_head and self._crossings == crossings:
            # The whole read is head so far, all of it held by the parser. A read that also
            # ended a request counts nothing of the next head: the next head may pass the
            # bound by that read at most before it is refused, and is measured whole once
            # it ends (``on_headers_complete``).
            self._head_fed += len(data)
            if self._head_fed > HEAD_MAX_BYTES:
                self._refuse_head(431, "headers_too_large", TOO_LARGE)

    # The parser's callbacks (httptools'): after a refusal the rest of the read is dropped.

    def on_message_begin(self) -> None:
        if self._refused:
            return
        super().on_message_begin()
        self._head_begun = True
        # The head's own deadline, from its first byte: the first request's does not count
        # the time the connection waited for it (a client may open one ahead of its request).
        self._stop_head_timer()
        self._start_head_timer()

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        self._in_head = False
        self._crossings += 1
        self._stop_head_timer()
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > HEAD_MAX_BYTES:
            self._refuse_head(431, "headers_too_large", TOO_LARGE)
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        self._in_head = True
        self._crossings += 1
        self._head_fed = 0
        self._head_begun = False
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        """What the parser could not read (a control character in a header, a bad
        Content-Length or chunk size, an unknown method or version) is answered 400
        ``invalid_http`` in problem+json, as every other error is (uvicorn's own answer was
        text/plain, without the headers every answer carries), and the connection closed."""
        if self._refused:  # what follows a refused head in the same read is no request
            return
        self._refused = True
        self._stop_head_timer()
        if self.transport.is_closing():
            return
        detail = "the request is not HTTP/1.1 this server can read"
        self.transport.write(
            _problem(400, "invalid_http", detail, self.server_state.default_headers)
        )
        self.transport.close()

    # The head's bounds.

    def _start_head_timer(self) -> None:
        self._head_read_up = False
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_late)

    def _head_late(self) -> None:
        """The deadline has passed: judged only once the loop has read what waits for it.
        libuv (uvloop, what the API runs on) runs the timers that are due before it polls for
        reads, so after a stall of the loop (a long callback, a GC or VM pause, SIGSTOP) a
        head that arrived whole in time still waits in the kernel as its deadline fires: it
        was answered 408. ``READ_FIRST_S`` later the loop has polled, read it and stopped this
        timer; what is still not whole then is late."""
        self._head_timer = None
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined head behind an answer still under way: bounded in size meanwhile.
            self._start_head_timer()
        elif not self._head_read_up:
            self._head_read_up = True
            self._head_timer = self.loop.call_later(READ_FIRST_S, self._head_late)
        elif self._head_begun:
            late = f"the request's line and headers did not arrive within {HEAD_TIMEOUT_S:g} s"
            self._refuse_head(408, "head_timeout", late)
        elif not self.transport.is_closing():
            self.transport.close()  # nothing asked, nothing to answer

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _refuse_head(self, status: int, code: str, detail: str) -> None:
        """Answer ``status`` and end the connection. Once the client has had the answer and
        the end of it, what it still sends is read and dropped, for ``LINGER_S`` at most."""
        self._refused = True
        self._stop_head_timer()
        if self.transport.is_closing():  # already answered (uvicorn's 400) or gone
            return
        log.info("a request's head was refused %d %s", status, code)
        if self.cycle is not None and not self.cycle.response_complete:
            reset(self.transport)  # a pipelined head: no answer may go before the one under way
            return
        self.transport.write(_problem(status, code, detail, self.server_state.default_headers))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._linger = self.loop.call_later(LINGER_S, reset, self.transport)


def _problem(status: int, code: str, detail: str, headers: list[tuple[bytes, bytes]]) -> bytes:
    """The whole answer, problem+json as ``api.errors.problem`` writes it; no request was
    read, so no trace and no path."""
    phrase = HTTPStatus(status).phrase
    body = json.dumps(
        {
            "type": f"urn:reach:problem:{code}",
            "title": phrase,
            "status": status,
            "detail": detail,
            "code": code,
            "trace_id": None,
        }
    ).encode()
    head = [f"HTTP/1.1 {status} {phrase}".encode()]
    head += [name + b": " + value for name, value in headers]
    head += [
        b"content-type: " + PROBLEM_JSON.encode(),
        b"x-content-type-options: nosniff",
        b"content-security-policy: " + DATA_CSP.encode(),
        b"content-length: " + str(len(body)).encode(),
        b"connection: close",
    ]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def bound_send_buffer(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):  # not a TCP socket, or the platform refuses
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)


def reset(transport: Any) -> None:
    """Abort the connection with a reset, so the kernel drops what it held for the client too
    (closed with bytes unsent, a socket lingers in the kernel until its retries run out)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class Counted:
    """A transport that counts the bytes written to it; everything else is the transport's."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self.written = 0
        sock = transport.get_extra_info("socket")
        self._fd = sock.fileno() if sock is not None else -1

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += len(data)
        self._transport.write(data)

    def writelines(self, chunks: Any) -> None:
        for chunk in chunks:
            self.write(chunk)

    def waiting(self) -> int:
        """The bytes written that the client has not acknowledged: those still here, and
        those the kernel holds (``TIOCOUTQ``, where the platform tells)."""
        return self._transport.get_write_buffer_size() + _unacknowledged(self._fd)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _unacknowledged(fd: int) -> int:
    if fd < 0 or termios is None or not hasattr(termios, "TIOCOUTQ"):
        return 0
    try:
        return int(struct.unpack("i", fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0\0\0\0"))[0])
    except OSError:
        return 0


class Stall:
    """Every ``stall_s``: if bytes waited for the client at the last look and still do, and it
    acknowledged less than ``MIN_TAKEN_BYTES`` of them meanwhile (or all that waited, if
    less), the connection is reset. A client reading at about half a KiB a second or more
    keeps it; one that has stopped loses it within twice ``stall_s``."""

    def __init__(self, transport: Counted, loop: asyncio.AbstractEventLoop, stall_s: float) -> None:
        self.transport = transport
        self.loop = loop
        self.stall_s = stall_s
        self._delivered = 0
        self._waiting = 0
        self._timer: asyncio.TimerHandle | None = loop.call_later(stall_s, self._look)

    def _look(self) -> None:
        transport = self.transport
        waiting = transport.waiting()
        delivered = transport.written - waiting
        progress = delivered - self._delivered
        if waiting and self._waiting and progress < min(MIN_TAKEN_BYTES, self._waiting):
            log.info(
                "a client took %d bytes in %gs with %d waiting for it: its connection is reset",
                progress,
                self.stall_s,
                waiting,
            )
            self._timer = None
            reset(transport)
            return
        self._delivered, self._waiting = delivered, waiting
        self._timer = self.loop.call_later(self.stall_s, self._look)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
