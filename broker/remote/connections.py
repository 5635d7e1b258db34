"""How the broker connects to remote agents: only to addresses agents may reach
(``REACH_AGENT_NETWORKS`` and public ones), decided on each connection's own lookup.

GuardedResolver   aiohttp's resolver, filtered through the SSRF guard
address_refused   whether a URL's host is an IP address agents may not reach
GuardedConnector  aiohttp's connector checking both on each new connection
guarded_session   an aiohttp session on it, with no limit on connections
read_body         a whole answer, up to a size
undecodable       whether aiohttp's failure to read a body is its encoding's (the agent's fault)
no_cookies        a cookie jar for httpx clients that calls agents: it keeps nothing
AiohttpTransport  an httpx transport over such a session, for clients that only speak httpx
                  (the a2a-sdk's): hundreds of calls in flight are aiohttp's strength, not
                  httpx's pool (``docs/performance.md``)
AnswerTooLarge    what its answers raise past ``MAX_ANSWER_BYTES`` or ``MAX_ANSWER_ELEMENTS``
JsonElements      a count of a JSON text's elements as it arrives, in pieces
"""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from errno import EACCES
from http.cookiejar import CookieJar, DefaultCookiePolicy
from ipaddress import ip_address
from typing import Any

import aiohttp
import httpx
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.http_exceptions import ContentEncodingError
from aiohttp.resolver import ThreadedResolver
from aiohttp.tracing import Trace

from broker.webhooks.ssrf import Guard

CONNECT_TIMEOUT_S = 5.0
MAX_ANSWER_BYTES = 16 * 2**20  # an answer, or one event of an event stream
# The elements (``JsonElements``) an answer or an event of an ``AiohttpTransport``'s may hold:
# the a2a-sdk turns each into protobuf in Python, about 1.5 us an element, on the loop that
# makes every tenant's calls (16 MiB of ``[0,0,...]`` took 12 s), and the bridge turns it
# back. 100,000 cost about 0.25 s together.
MAX_ANSWER_ELEMENTS = 100_000
# Where an event of an event stream ends: a line ending followed by an empty line.
_EVENT_END = re.compile(rb"\n[\r\n]|\r\r")
# Events of an event stream without a data line (blank lines, comments) it may send in a row:
# 4 MiB of line ends held the bridge's loop for 2.5 s in the a2a-sdk's reader.
MAX_EMPTY_EVENTS = 1_000
# An event stream's body goes to its reader in pieces of at most this, the loop running its
# other calls between two: the reader parses each piece's lines without a pause.
STREAM_PIECE_BYTES = 16 * 1024
# Set by the session itself, or meaningless once the request is aiohttp's.
_NOT_FORWARDED = frozenset({"host", "content-length", "connection", "transfer-encoding"})
# aiohttp decompresses the body; httpx must not try again, nor trust the encoded length.
_NOT_RETURNED = frozenset({"content-encoding", "content-length", "transfer-encoding"})
# The rest of a JSON string from inside it, up to its closing quote, a lone backslash at the
# end of the text, or a line end (which no JSON string holds). Possessive: linear, whatever
# the escapes.
_IN_STRING = re.compile(rb'(?:[^"\\\r\n]++|\\[^\r\n])*+')


class GuardedResolver(AbstractResolver):
    """Host names resolve only to addresses agents may reach, checked on the connection's own
    lookup: a name that resolved to an allowed address when it was registered cannot be
    pointed at another one later (DNS rebinding). A host name listed in
    ``REACH_AGENT_NETWORKS`` may resolve anywhere, as ``Guard.check`` lets it register.
    aiohttp asks no resolver for an address written in the URL: ``guarded_session`` checks
    those (``address_refused``)."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard
        self._resolver = ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await self._resolver.resolve(host, port, family)
        if host.lower().rstrip(".") in self.guard.allowed_hosts:
            return found  # listed by name: every address it resolves to, as registration let it
        allowed = [r for r in found if self.guard.address_allowed(r["host"])]
        if not allowed:
            raise OSError(EACCES, f"{host} resolves only to addresses agents may not reach")
        return allowed

    async def close(self) -> None:
        await self._resolver.close()


def address_refused(guard: Guard, host: str) -> bool:
    """Whether ``host`` (a URL's, as aiohttp connects to it) is an IP address agents may not
    reach. A name is not: the resolver judges the addresses it resolves to."""
    try:
        address = ip_address(host.strip("[]"))
    except ValueError:
        return False  # a name, or a form aiohttp refuses itself ("127.1")
    return not guard.address_allowed(str(address))


class GuardedConnector(aiohttp.TCPConnector):
    """Every new connection's addresses checked: a name's by the resolver (``GuardedResolver``),
    an address written in the URL here, as aiohttp gives it to no resolver. Per connection,
    not per request: a kept-alive connection was checked when it was made. Refused, either
    fails the call as a name that resolves nowhere does (``ClientConnectorDNSError``)."""

    def __init__(self, guard: Guard, **kwargs: Any) -> None:
        super().__init__(resolver=GuardedResolver(guard), **kwargs)
        self._guard = guard

    async def _resolve_host(
        self, host: str, port: int, traces: Sequence[Trace] | None = None
    ) -> list[ResolveResult]:
        if address_refused(self._guard, host):
            raise OSError(EACCES, f"{host} is an address agents may not reach")
        return await super()._resolve_host(host, port, traces)


def guarded_session(guard: Guard) -> aiohttp.ClientSession:
    """A session for calling agents, on the running loop: no limit on connections (the
    caller's concurrency is the limit), connections made within ``CONNECT_TIMEOUT_S``, each
    only to an address agents may reach (``GuardedConnector``), whatever URL made it. It
    keeps no cookies: one session makes every tenant's calls, so a cookie an agent set while
    answering one tenant's task would go out with the next tenant's, and a jar that agents
    fill grows for as long as the process runs."""
    connector = GuardedConnector(guard, limit=0, ttl_dns_cache=60)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        auto_decompress=True,
        cookie_jar=aiohttp.DummyCookieJar(),
    )


async def read_body(response: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    """The whole body, or its first ``max_bytes + 1`` bytes when it is longer (the caller
    refuses it then). aiohttp's ``read(n)`` answers what has arrived, up to n bytes: a body
    that came in several pieces was cut at the first."""
    data = bytearray()
    while len(data) <= max_bytes and (
        chunk := await response.content.read(max_bytes + 1 - len(data))
    ):
        data += chunk
    return bytes(data)


def undecodable(exc: BaseException) -> bool:
    """Whether a body could not be read because its ``Content-Encoding`` could not be
    undone (gzip, deflate, br or zstd that is not): the agent's answer is broken, as JSON that
    is not would be, and a retry gets the same. aiohttp raises ``ClientPayloadError`` for it
    and for a connection that broke off alike, and ``ClientResponseError`` for an encoding
    it cannot undo at all (``br`` without Brotli installed, which it never asks for) and for
    any other broken head; the chain of causes tells them apart."""
    cause = exc.__cause__
    for _ in range(4):  # aiohttp's chains are two deep
        if cause is None or isinstance(cause, ContentEncodingError):
            break
        cause = cause.__cause__
    return isinstance(cause, ContentEncodingError)


def no_cookies() -> CookieJar:
    """For an httpx client that calls agents (``httpx.AsyncClient(cookies=no_cookies())``):
    httpx keeps every cookie an answer sets and sends it with the next request to that host,
    whatever its transport. A client shared by every tenant's calls must not (see
    ``guarded_session``), so this jar's policy accepts none."""
    return CookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))


class AiohttpTransport(httpx.AsyncBaseTransport):
    """httpx requests sent with an aiohttp session (``session()`` gives the running loop's).
    Redirects are never followed; aiohttp's failures become httpx's, so a client written for
    httpx tells a failed connection from a slow answer as it would with httpx's own pool."""

    def __init__(self, session: Callable[[], aiohttp.ClientSession]) -> None:
        self.session = session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        limits = request.extensions.get("timeout") or {}
        timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=limits.get("connect") or CONNECT_TIMEOUT_S,
            sock_read=limits.get("read"),
        )
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED]
        try:
            answer = await self.session().request(
                request.method,
                str(request.url),
                headers=headers,
                data=await request.aread(),
                allow_redirects=False,
                timeout=timeout,
            )
        except aiohttp.ConnectionTimeoutError as exc:
            raise httpx.ConnectTimeout(str(exc) or "connect timeout", request=request) from exc
        except TimeoutError as exc:
            raise httpx.ReadTimeout(str(exc) or "read timeout", request=request) from exc
        except aiohttp.ClientConnectorError as exc:
            raise httpx.ConnectError(str(exc), request=request) from exc
        except aiohttp.ClientError as exc:
            message = f"{type(exc).__name__}: {exc}"
            if undecodable(exc):
                raise httpx.DecodingError(message, request=request) from exc
            raise httpx.ReadError(message, request=request) from exc
        returned = [
            (k, v)
            for k, v in answer.raw_headers
            if k.decode("latin-1").lower() not in _NOT_RETURNED
        ]
        streamed = _an_event_stream(request, returned)
        return httpx.Response(
            answer.status,
            headers=returned,
            stream=_Body(answer, request, streamed=streamed),
            request=request,
        )


def _an_event_stream(request: httpx.Request, returned: list[tuple[bytes, bytes]]) -> bool:
    """Whether an answer is read as an event stream, one event at a time: the request asked
    for one (``Accept``), and its content type says one as the a2a-sdk looks for it, word for
    word. Else a client reads it whole (the SDK's one-answer calls, and an answer whose type
    is ``Text/Event-Stream``): it is held to ``MAX_ANSWER_BYTES`` whole, not event by event,
    which let an endless stream of events grow in memory until the task's deadline."""
    if "text/event-stream" not in request.headers.get("accept", ""):
        return False
    types = [v for k, v in returned if k.lower() == b"content-type"]
    return bool(types) and b"text/event-stream" in types[-1]


class AnswerTooLarge(httpx.DecodingError):
    """An answer longer than ``MAX_ANSWER_BYTES`` or holding more than ``MAX_ANSWER_ELEMENTS``,
    or an event of an event stream that is: a client reading it (the a2a-sdk's holds a whole
    answer, and a whole event, in memory, and parses it) gets this instead of the rest, and
    the agent's connection is closed."""


class JsonElements:
    """How many elements a JSON text holds, counted as it arrives in pieces (``add``): each
    string, and each ``,`` ``:`` ``[`` ``{`` outside strings, so about two for an array's
    value and three for an object's member. Neither parsed nor checked: a text that is not
    JSON is counted all the same, and its reader refuses it. A line end ends a string (no
    JSON string holds one), so the lines of an event stream that are not JSON cannot hide
    the next one's structure in a string they open."""

    def __init__(self) -> None:
        self.count = 0
        self._in_string = False
        self._escaped = False  # the piece ended with a backslash in a string

    def add(self, data: bytes, start: int = 0, end: int | None = None, most: int = 0) -> int:
        """Count ``data[start:end]``; stop once past ``most`` (when given). The count so far.
        Each turn of the loop passes a string, so the loop turns about ``count`` times."""
        end = len(data) if end is None else end
        while start < end and not (most and self.count > most):
            if self._in_string:
                start = self._in_string_from(data, start, end)
                continue
            quote = data.find(b'"', start, end)
            stop = end if quote < 0 else quote
            self.count += (
                data.count(b",", start, stop)
                + data.count(b":", start, stop)
                + data.count(b"[", start, stop)
                + data.count(b"{", start, stop)
            )
            if quote < 0:
                break
            self.count += 1
            self._in_string, start = True, quote + 1
        return self.count

    def _in_string_from(self, data: bytes, start: int, end: int) -> int:
        """Where the string going on at ``start`` ends, or ``end``."""
        if self._escaped:
            self._escaped = False
            self._in_string = data[start] not in b"\r\n"
            return start + 1
        found = _IN_STRING.match(data, start, end)  # it matches "" too: never None
        at = found.end() if found else start
        if at < end:
            if data[at] == ord("\\"):  # then the text's end, or a line end
                self._escaped = at + 1 == end
                self._in_string = self._escaped
            else:  # its closing quote, or a line end
                self._in_string = False
            at += 1
        return at


class _Body(httpx.AsyncByteStream):
    """The answer's body, decompressed (``auto_decompress``), at most ``MAX_ANSWER_BYTES`` and
    ``MAX_ANSWER_ELEMENTS`` of it; for an event stream (``streamed``: ``_an_event_stream``),
    of each event. Both are checked on
    each piece before the client gets it, so a client parsing each event as it ends never
    gets one past them."""

    def __init__(
        self, answer: aiohttp.ClientResponse, request: httpx.Request, *, streamed: bool
    ) -> None:
        self._answer = answer
        self._request = request
        self._streamed = streamed

    async def __aiter__(self) -> AsyncIterator[bytes]:
        streamed = self._streamed
        size, tail, elements, empty = 0, b"", JsonElements(), 0
        try:
            async for chunk in self._answer.content.iter_any():
                # Offsets in ``chunk`` past each event's end (an event ending in it is no
                # longer than the chunk, but the first may have begun before it).
                found = _EVENT_END.finditer(tail + chunk) if streamed else ()
                ends = [m.end() - len(tail) for m in found]
                if size + (ends[0] if ends else len(chunk)) > MAX_ANSWER_BYTES:
                    raise AnswerTooLarge("the agent's answer is too large", request=self._request)
                segments = zip([0, *ends], [*ends, len(chunk)], strict=True)
                for at, (start, end) in enumerate(segments):
                    if start:
                        elements = JsonElements()  # a new event
                    if at < len(ends):  # an event ends at ``end``
                        empty = self._empty_after(chunk, start, end, size, empty)
                    if elements.add(chunk, start, end, MAX_ANSWER_ELEMENTS) > MAX_ANSWER_ELEMENTS:
                        raise AnswerTooLarge(
                            f"the agent's answer holds more than {MAX_ANSWER_ELEMENTS} elements",
                            request=self._request,
                        )
                size = len(chunk) - ends[-1] if ends else size + len(chunk)
                tail = chunk[-1:]
                if not streamed or len(chunk) <= STREAM_PIECE_BYTES:
                    yield chunk
                    continue
                for at in range(0, len(chunk), STREAM_PIECE_BYTES):
                    yield chunk[at : at + STREAM_PIECE_BYTES]
                    await asyncio.sleep(0)
        except TimeoutError as exc:
            raise httpx.ReadTimeout(str(exc) or "read timeout", request=self._request) from exc
        except aiohttp.ClientError as exc:
            message = f"{type(exc).__name__}: {exc}"
            if undecodable(exc):
                raise httpx.DecodingError(message, request=self._request) from exc
            raise httpx.ReadError(message, request=self._request) from exc

    def _empty_after(self, chunk: bytes, start: int, end: int, carried: int, empty: int) -> int:
        """How many events without a data line have ended in a row, with the one that ends at
        ``end`` (begun at ``start``, or in an earlier chunk when ``start`` is 0 and bytes of
        it were ``carried``: it may have had one there)."""
        if (start == 0 and carried) or chunk.find(b"data", start, end) >= 0:
            return 0
        if empty + 1 > MAX_EMPTY_EVENTS:
            raise AnswerTooLarge(
                f"the agent's stream sent more than {MAX_EMPTY_EVENTS} events without data "
                "in a row",
                request=self._request,
            )
        return empty + 1

    async def aclose(self) -> None:
        self._answer.release()  # back to the pool when read to the end, else closed
