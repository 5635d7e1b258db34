"""One webhook HTTP attempt, connected only to an address the guard checked.

The host is resolved once by the guard; the request goes to that IP with the original
``Host`` header, and for https with SNI and certificate checks on the host name. No proxy
from the environment, no redirects, no decompression, and the response is read only up to
its cap, so a receiver cannot make us reach elsewhere or hold much memory.
"""

from __future__ import annotations

import ssl
import time

import httpx

from broker.webhooks.policy import Outcome, parse_retry_after
from broker.webhooks.ssrf import Guard, HostUnresolved, Target, UrlNotAllowed

USER_AGENT = "Agent-Reach-Webhooks/0.1"
EXCERPT_BYTES = 512


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
    """POST ``body`` to ``url``; never raises for anything the network or receiver does."""
    started = time.monotonic()
    try:
        target = guard.check(url)
    except UrlNotAllowed as exc:
        return Outcome(error=f"url_not_allowed: {exc.message}", transient=False)
    except HostUnresolved as exc:
        return Outcome(error=f"dns: {exc.message}", latency_ms=_ms(started))
    outcome = Outcome(error="no address to connect to")
    with httpx.Client(
        follow_redirects=False, trust_env=False, verify=verify, timeout=timeout_s
    ) as client:
        for address in target.addresses:
            outcome = _attempt(
                client, target, address, body, headers, started, timeout_s, max_bytes
            )
            if not (outcome.error or "").startswith("connect:"):
                break  # only a failed connection is worth the host's next address
    return outcome


def _attempt(
    client: httpx.Client,
    target: Target,
    address: str,
    body: bytes,
    headers: dict[str, str],
    started: float,
    timeout_s: float,
    max_bytes: int,
) -> Outcome:
    request = client.build_request(
        "POST",
        target.url.copy_with(host=address, fragment=None),
        content=body,
        headers={
            **headers,
            "Host": target.url.netloc.decode("ascii"),
            "Content-Type": "application/json",
            "User-Agent": USER_AGENT,
            "Accept-Encoding": "identity",
        },
        extensions={"sni_hostname": target.host.rstrip(".")},
    )
    try:
        response = client.send(request, stream=True)
        try:
            excerpt = _read_capped(response, started, timeout_s, max_bytes)
        finally:
            response.close()
    except httpx.ConnectError as exc:
        return Outcome(error=f"connect: {exc}", latency_ms=_ms(started), address=address)
    except httpx.TimeoutException:
        return Outcome(
            error=f"timeout after {timeout_s:g} s", latency_ms=_ms(started), address=address
        )
    except (httpx.HTTPError, ssl.SSLError, OSError) as exc:
        return Outcome(
            error=f"{type(exc).__name__}: {exc}", latency_ms=_ms(started), address=address
        )
    return Outcome(
        status_code=response.status_code,
        latency_ms=_ms(started),
        address=address,
        excerpt=excerpt,
        retry_after_s=parse_retry_after(response.headers.get("retry-after")),
    )


def _read_capped(response: httpx.Response, started: float, timeout_s: float, max_bytes: int) -> str:
    """Up to ``max_bytes`` of the raw body; a receiver dripping bytes is cut at the timeout."""
    read = bytearray()
    for chunk in response.iter_raw():
        read += chunk
        if len(read) >= max_bytes:
            break
        if time.monotonic() - started > timeout_s:
            raise httpx.ReadTimeout("the response took longer than the timeout")
    # Postgres text refuses NUL; a short excerpt is enough to see what the receiver said.
    return bytes(read[:EXCERPT_BYTES]).decode("utf-8", "replace").replace("\x00", "")


def _ms(started: float) -> int:
    return int((time.monotonic() - started) * 1000)
