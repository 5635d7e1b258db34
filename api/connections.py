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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from typing import Any

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _Uvicorns
except ImportError:  # pragma: no cover - no httptools (PyPy, some platforms): uvicorn's other
    from uvicorn.protocols.http.h11_impl import H11Protocol as _Uvicorns  # type: ignore[assignment]

try:
    import fcntl
    import termios
except ImportError:  # pragma: no cover - not a Unix: the kernel's share is not counted
    fcntl = termios = None  # type: ignore[assignment]

SEND_BUFFER_BYTES = 128 * 1024
MIN_TAKEN_BYTES = 16 * 1024  # in each REACH_CLIENT_STALL_S while bytes wait: about 0.5 KiB/s
STALL_KEY = "reach.client_stall_s"  # the lifespan state's entry (``api.app``)
DEFAULT_STALL_S = 30.0
log = logging.getLogger("reach.api")


class Protocol(_Uvicorns):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        bound_send_buffer(transport)
        counted = Counted(transport)
        self._stall = Stall(
            counted, self.loop, float(self.app_state.get(STALL_KEY, DEFAULT_STALL_S))
        )
        super().connection_made(counted)  # type: ignore[arg-type]

    def connection_lost(self, exc: Exception | None) -> None:
        self._stall.stop()
        super().connection_lost(exc)


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
