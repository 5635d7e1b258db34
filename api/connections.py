"""The HTTP protocol the API is served with: ``uvicorn ... --http api.connections:Protocol``.

uvicorn's own protocol (httptools', or h11's where httptools is not installed), with each
connection's kernel send buffer bounded to ``SEND_BUFFER_BYTES`` (the kernel doubles it for
its bookkeeping). Left to autotuning, a client that stops reading lets the kernel hold up
to ``net.ipv4.tcp_wmem``'s maximum for it (4 MiB by default): a tenant's 1,000 open streams
(``REACH_MAX_STREAMS_PER_TENANT``) that read nothing held about 3.7 GB of one API process's
memory until the send timeout dropped them. 128 KiB carries a page of any listing (1 MiB at
most) in a few turns of the loop, and loopback and LAN round trips fill it many times a
second; a client a long way off reads a large answer at up to this much per round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _Uvicorns
except ImportError:  # pragma: no cover - no httptools (PyPy, some platforms): uvicorn's other
    from uvicorn.protocols.http.h11_impl import H11Protocol as _Uvicorns  # type: ignore[assignment]

SEND_BUFFER_BYTES = 128 * 1024


class Protocol(_Uvicorns):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        bound_send_buffer(transport)
        super().connection_made(transport)


def bound_send_buffer(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):  # not a TCP socket, or the platform refuses
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
