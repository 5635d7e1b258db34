"""One webhook HTTP attempt, connected only to an address the guard checked.

The host is resolved once by the guard; the request goes to that IP with the original
``Host`` header, and for https with SNI and certificate checks on the host name. No proxy
from the environment, no redirects, no decompression, and the response is read only up to
its cap, so a receiver cannot make us reach elsewhere or hold much memory. The whole attempt,
resolution to the last byte read, ends by one deadline (``timeout_s``): a receiver that
dribbles its headers or body is cut there, however steadily it sends.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from dataclasses import replace
from urllib.parse import urlsplit

import httpcore
import httpx

from broker.timestamps import parse_retry_after
from broker.webhooks.policy import Outcome
from broker.webhooks.ssrf import Guard, HostUnresolved, Target, UrlNotAllowed
from workers.system.deadline import Deadline, DeadlineBackend

log = logging.getLogger("reach.webhooks")
USER_AGENT = "Agent-Reach-Webhooks/0.1"
# What the delivery log says of an attempt the sender could not make: no exception text.
SENDER_ERROR = "the attempt failed in the sender; it is not retried"
EXCERPT_BYTES = 512
_NETWORK_ERRORS = (
    httpcore.NetworkError,
    httpcore.ProtocolError,
    httpcore.UnsupportedProtocol,
    ssl.SSLError,
    OSError,
)


def send(
    guard: Guard,
    url: str,
    body: bytes,
    headers: dict[str, str],
    *,
    timeout_s: float,
    max_bytes: int,
    verify: ssl.SSLContext | bool = True,
) -> Outcome:
    """POST ``body`` to ``url``; returns within ``timeout_s`` of being called (given a
    resolver that does) and never raises. What the network or receiver does is the outcome;
    an error of ours is an attempt failed for good (a task that raised recorded nothing,
    released nothing, and the sweep made its attempt due again at once, as lost)."""
    try:
        return _send(guard, url, body, headers, timeout_s, max_bytes, verify)
    except Exception:
        log.exception("webhook attempt to %s failed in the sender", _logged(url))
        return Outcome(error=SENDER_ERROR, transient=False)


def _logged(url: str) -> str:
    """A receiver's URL as a log line may show it: its origin alone. Receivers put their
    tokens in the query (``?token=...``) and in the path (Slack's and Discord's hooks); the
    guard refuses userinfo already."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def _send(
    guard: Guard,
    url: str,
    body: bytes,
    headers: dict[str, str],
    timeout_s: float,
    max_bytes: int,
    verify: ssl.SSLContext | bool,
) -> Outcome:
    started = time.monotonic()
    deadline = Deadline(timeout_s)
    try:
        target = _check(guard, url, deadline)
    except UrlNotAllowed as exc:
        return Outcome(error=f"url_not_allowed: {exc.message}", transient=False)
    except HostUnresolved as exc:
        return Outcome(error=f"dns: {exc.message}", latency_ms=_ms(started))
    outcome = Outcome(error="no address to connect to")
    pool = httpcore.ConnectionPool(
        ssl_context=httpx.create_ssl_context(verify=verify, trust_env=False),
        max_keepalive_connections=0,
        network_backend=DeadlineBackend(deadline),
    )
    with pool:
        for address in target.addresses:
            outcome = _attempt(pool, target, address, body, headers, deadline, max_bytes)
            if outcome.error == "timeout" or (outcome.error and deadline.passed):
                # However the cut showed (a timeout, a reset), the attempt ran out of time.
                outcome = replace(outcome, error=f"timeout: no answer within {timeout_s:g} s")
            outcome = replace(outcome, latency_ms=_ms(started))
            if not (outcome.error or "").startswith("connect:"):
                break  # only a failed connection is worth the host's next address
    return outcome


def _check(guard: Guard, url: str, deadline: Deadline) -> Target:
    """``guard.check`` in a thread of its own, waited for until the deadline: a name server
    that never answers costs the attempt its time, not more (the thread ends when the
    system resolver gives up)."""
    found: list[Target | Exception] = []

    def check() -> None:
        try:
            found.append(guard.check(url))
        except Exception as exc:  # handed to the caller below
            found.append(exc)

    thread = threading.Thread(target=check, name="reach-webhook-dns", daemon=True)
    thread.start()
    thread.join(max(deadline.at - time.monotonic(), 0.0))
    if not found:
        raise HostUnresolved("the host did not resolve before the attempt's deadline")
    if isinstance(found[0], Exception):
        raise found[0]
    return found[0]


def _attempt(
    pool: httpcore.ConnectionPool,
    target: Target,
    address: str,
    body: bytes,
    headers: dict[str, str],
    deadline: Deadline,
    max_bytes: int,
) -> Outcome:
    url = httpcore.URL(
        scheme=target.url.raw_scheme,
        host=address.encode("ascii"),
        port=target.port,
        target=target.url.raw_path,
    )
    sent = {
        **headers,
        "Host": target.url.netloc.decode("ascii"),
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        "Accept-Encoding": "identity",
    }
    # The backend holds every operation to the deadline; these only have to be no shorter.
    left = max(deadline.at - time.monotonic(), 0.001)
    extensions = {
        "timeout": dict.fromkeys(("connect", "read", "write", "pool"), left),
        "sni_hostname": target.host.rstrip("."),
    }
    try:
        with pool.stream(
            "POST", url, headers=list(sent.items()), content=body, extensions=extensions
        ) as answer:
            excerpt = _read_capped(answer, max_bytes)
    except httpcore.ConnectError as exc:
        return Outcome(error=f"connect: {exc}", address=address)
    except httpcore.TimeoutException:
        return Outcome(error="timeout", address=address)
    except _NETWORK_ERRORS as exc:
        return Outcome(error=f"{type(exc).__name__}: {exc}", address=address)
    return Outcome(
        status_code=answer.status,
        address=address,
        excerpt=excerpt,
        retry_after_s=parse_retry_after(_header(answer, b"retry-after")),
    )


def _read_capped(response: httpcore.Response, max_bytes: int) -> str:
    """Up to ``max_bytes`` of the raw body (the deadline bounds how long that takes)."""
    read = bytearray()
    for chunk in response.iter_stream():
        read += chunk
        if len(read) >= max_bytes:
            break
    # Postgres text refuses NUL; a short excerpt is enough to see what the receiver said.
    return bytes(read[:EXCERPT_BYTES]).decode("utf-8", "replace").replace("\x00", "")


def _header(response: httpcore.Response, name: bytes) -> str | None:
    for key, value in response.headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _ms(started: float) -> int:
    return int((time.monotonic() - started) * 1000)
