"""The SSRF guard: which webhook URLs we accept and which addresses we connect to.

A URL must be http(s), without userinfo, with a plain host name or IP literal. Its host is
resolved once; the addresses that pass the deny table (or the allow setting) are the only
ones the sender may connect to, so a DNS answer that changes after the check never counts.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from ipaddress import IPv4Network, IPv6Network, ip_address, ip_network
from urllib.parse import urlsplit

import httpx

from broker.errors import BadRequest, Unavailable
from broker.tasks.backpressure import RateLimited
from broker.webhooks.addresses import effective, is_denied

URL_MAX = 2048
MAX_PORT = 65535
_LABEL = r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9])?"
_HOSTNAME = re.compile(rf"(?:{_LABEL}\.)*{_LABEL}\.?")

Resolver = Callable[[str, int], list[str]]


class UrlNotAllowed(BadRequest):
    code = "url_not_allowed"


class HostUnresolved(Unavailable):
    code = "host_unresolved"


def unreachable(host: str) -> str:
    """What a caller is told of a host it may not name: the same whether the host does not
    resolve or resolves only to refused addresses, so that no tenant learns from it which
    internal names exist."""
    return (
        f"{host} does not resolve to an address that may be reached (it has none, or only "
        "loopback, private, link-local, reserved ... ones)"
    )


def system_resolver(host: str, port: int) -> list[str]:
    """Every address the system resolver gives for ``host``, in its order, once each."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise HostUnresolved(f"{host} does not resolve") from None
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


@dataclass(frozen=True)
class Target:
    """A checked URL and the addresses it may be reached at."""

    url: httpx.URL
    host: str  # ASCII (IDNA) host name or IP literal, lowercase
    port: int
    addresses: tuple[str, ...]


def parse_url(raw: str) -> httpx.URL:
    """The URL if its form is acceptable, else UrlNotAllowed saying why."""
    if len(raw) > URL_MAX or any(c.isspace() or ord(c) < 0x20 or c == "\\" for c in raw):
        raise UrlNotAllowed("the URL is too long or holds spaces, control characters or '\\'")
    try:
        url = httpx.URL(raw)
    except (httpx.InvalidURL, ValueError) as exc:
        raise UrlNotAllowed(f"not a valid URL: {exc}") from None
    if url.scheme not in ("http", "https"):
        raise UrlNotAllowed("only http and https URLs are allowed")
    if url.userinfo or "@" in url.netloc.decode("ascii", "replace"):
        raise UrlNotAllowed("credentials in the URL are not allowed")
    host = url.raw_host.decode("ascii").lower()
    # No zone ids ('%'): an interface-scoped address is local by definition.
    if not host or "%" in host or not (_is_ip(host) or _HOSTNAME.fullmatch(host)):
        raise UrlNotAllowed("the URL needs a plain host name or IP address")
    _check_port(raw)
    return url


def _check_port(raw: str) -> None:
    """A port, when the URL names one, of ASCII digits from 1 to 65535. httpx takes the port
    as Python's ``int`` does (``+44057``, other scripts' digits) and past 65535, where one
    client wrapped it (109593 reached port 44057) and another refused to connect."""
    authority = urlsplit(raw).netloc
    _, colon, port = authority.rpartition(":")
    named = colon and "]" not in port  # not a colon inside an IPv6 literal
    if named and not (port.isascii() and port.isdigit() and 0 < int(port) <= MAX_PORT):
        raise UrlNotAllowed("the port must be a number from 1 to 65535")


def _is_ip(host: str) -> bool:
    try:
        ip_address(host)
    except ValueError:
        return False
    return True


class Guard:
    """Decides which URLs and addresses a webhook may reach.

    ``allow`` entries are host names (matched exactly), IP addresses or networks; an allowed
    address is judged by its embedded IPv4 form too, like a denied one."""

    def __init__(self, allow: Iterable[str] = (), resolver: Resolver = system_resolver) -> None:
        self.resolver = resolver
        self.allowed_hosts: set[str] = set()
        self.allowed_networks: list[IPv4Network | IPv6Network] = []
        for entry in (e.strip().lower().rstrip(".") for e in allow):
            try:
                self.allowed_networks.append(ip_network(entry.strip("[]"), strict=False))
            except ValueError:
                self.allowed_hosts.add(entry)

    def address_allowed(self, address: str) -> bool:
        ip = ip_address(address.split("%", 1)[0])
        for candidate in (ip, effective(ip)):
            if any(candidate in network for network in self.allowed_networks):
                return True
        return not is_denied(ip)

    def check(self, raw: str) -> Target:
        """Parse, resolve once, and keep the addresses that may be reached.

        UrlNotAllowed when the form is wrong or no address passes; HostUnresolved when the
        name does not resolve (a delivery retries that, a registration refuses it)."""
        url = parse_url(raw)
        host = url.raw_host.decode("ascii").lower()
        port = url.port or (443 if url.scheme == "https" else 80)
        addresses = self.resolver(host, port)
        if host.rstrip(".") in self.allowed_hosts:
            return Target(url, host, port, tuple(addresses))
        passed = tuple(a for a in addresses if self.address_allowed(a))
        if not passed:
            raise UrlNotAllowed(unreachable(host))
        return Target(url, host, port, passed)


class HostLookups:
    """Where the API checks the URLs callers send: in threads of its own, never the pool the
    API's other blocking work shares; each check bounded to ``timeout_s``; at most
    ``per_tenant`` checks of one tenant in flight. A check whose caller stopped waiting stays
    counted until its thread returns, so a name server that never answers ties up only the
    lookups of the tenant that named it."""

    def __init__(
        self,
        *,
        threads: int,
        timeout_s: float,
        per_tenant: int,
        resolver: Resolver = system_resolver,
    ) -> None:
        self.resolver = resolver
        self.timeout_s = timeout_s
        self.per_tenant = per_tenant
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="reach-dns")
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}

    async def vet(self, raw: str, *, allow: Iterable[str], tenant: str) -> str:
        """Check a URL a caller submits (registration or a task's callback): UrlNotAllowed when
        its form or every address it resolves to is refused, or when it does not resolve in
        time; RateLimited when the tenant already has its share of checks in flight."""
        host = parse_url(raw).raw_host.decode("ascii").lower()  # a malformed URL costs no thread
        self._enter(tenant)
        future = self._pool.submit(Guard(allow, self.resolver).check, raw)
        future.add_done_callback(lambda _: self._leave(tenant))
        try:
            async with asyncio.timeout(self.timeout_s):
                await asyncio.wrap_future(future)
        except HostUnresolved:
            raise UrlNotAllowed(unreachable(host)) from None
        except TimeoutError:
            raise UrlNotAllowed(
                f"the URL's host did not resolve within {self.timeout_s:g} s"
            ) from None
        return raw

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _enter(self, tenant: str) -> None:
        with self._lock:
            if self._in_flight.get(tenant, 0) >= self.per_tenant:
                raise RateLimited(
                    "this tenant already has host names being resolved; retry shortly",
                    retry_after_s=max(1, round(self.timeout_s)),
                )
            self._in_flight[tenant] = self._in_flight.get(tenant, 0) + 1

    def _leave(self, tenant: str) -> None:
        with self._lock:
            left = self._in_flight[tenant] - 1
            if left:
                self._in_flight[tenant] = left
            else:
                del self._in_flight[tenant]
