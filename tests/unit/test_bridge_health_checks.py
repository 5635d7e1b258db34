"""The bridge's health checks (``workers.bridge.health_checks``) against real servers on
loopback: each check ends by its deadline whatever the agent sends, reads at most its cap,
and connects only where the guard lets each connection's own lookup go."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from broker.remote import a2a_card
from broker.remote.registration import A2A, HTTP, RemoteAgent
from broker.webhooks.ssrf import Guard
from tests.eventually import eventually
from tests.integration.receiver import Receiver, Tarpit
from tests.unit.test_remote_a2a import card_json
from workers.bridge.health_checks import MAX_HEALTH_BYTES, HealthChecks

LOOPBACK = Guard(allow=["127.0.0.0/8"])
TIMEOUT_S = 1.0
# Each read of the check gets a byte well within the timeout: only a deadline on the whole
# check ends it.
DRIP = b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n"


def agent(agent_id: str, url: str, protocol: str = HTTP) -> RemoteAgent:
    return RemoteAgent(agent_id, "1.0.0", protocol, url, None, (), "secret")


@contextlib.contextmanager
def checks(guard: Guard = LOOPBACK) -> Iterator[HealthChecks]:
    found = HealthChecks(guard, TIMEOUT_S, lookup_threads=2)
    try:
        yield found
    finally:
        found.close()


class Server:
    """A raw server on loopback answering each connection with ``answer``; it counts the
    connections that ended (the client hung up, or ``answer`` returned)."""

    def __init__(self, answer: Callable[[socket.socket], None]) -> None:
        self.answer = answer
        self.ended = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.origin = f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def __enter__(self) -> Server:
        threading.Thread(target=self._serve, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._listener.close()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.recv(65536)
            self.answer(conn)
        self.ended += 1


def endless(conn: socket.socket) -> None:
    """200, then a body as fast as the client takes it, for as long as it reads."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
    chunk = b"x" * 65536
    while True:
        conn.sendall(chunk)


# A card whose interface is where the checks' guard lets agents be
CALLABLE = {"url": "http://127.0.0.1:9/rpc", "protocolBinding": "JSONRPC", "protocolVersion": "1.0"}


def card_in_pieces(conn: socket.socket, interface: dict[str, str] = CALLABLE) -> None:
    """A good card, sent in two pieces a moment apart."""
    body = json.dumps(card_json(supportedInterfaces=[interface])).encode()
    head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    conn.sendall(head + body[:20])
    time.sleep(0.2)
    conn.sendall(body[20:])


@pytest.mark.parametrize("protocol", [HTTP, A2A])
def test_given_an_agent_dripping_its_answer_expect_it_failed_and_the_others_passed(
    protocol: str,
) -> None:
    with (
        Tarpit(prefix=DRIP, drip_s=0.2) as drip,
        Receiver() as healthy,
        Server(card_in_pieces) as card,
        checks() as health,
    ):
        # When one round checks a dripping agent and two healthy ones
        outcomes = health.run(
            [
                agent("drip", drip.url, protocol),
                agent("healthy", healthy.url),
                agent("card", f"{card.origin}/card", A2A),
            ]
        )
        # Then only the dripping one failed, and the check hung up on it
        assert outcomes == {"drip": False, "healthy": True, "card": True}
        assert [r.path for r in healthy.requests] == ["/healthz"]
        held = eventually(lambda: drip.held, "the drip's connection", 5, 0.02)
        eventually(lambda: held[0].closed_at, "the connection to end", 5, 0.02)
        assert [h.cut_by_client for h in held] == [True]


def test_given_a_body_that_never_ends_expect_a_failure_past_the_cap_and_a_hang_up() -> None:
    with Server(endless) as agent_server, checks() as health:
        assert health.run([agent("endless", f"{agent_server.origin}/run")]) == {"endless": False}
        eventually(lambda: agent_server.ended, "the check to hang up", 5, 0.02)


def test_given_a_healthz_body_within_the_cap_expect_a_pass() -> None:
    def just_under(conn: socket.socket) -> None:
        body = b"x" * MAX_HEALTH_BYTES
        conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)

    with Server(just_under) as agent_server, checks() as health:
        assert health.run([agent("big", f"{agent_server.origin}/run")]) == {"big": True}


def test_given_a_card_past_its_cap_expect_a_failure() -> None:
    def too_big(conn: socket.socket) -> None:
        body = b" " * a2a_card.MAX_CARD_BYTES + json.dumps(card_json()).encode()
        conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)

    with Server(too_big) as agent_server, checks() as health:
        assert health.run([agent("big", f"{agent_server.origin}/card", A2A)]) == {"big": False}


class HeldChecks(HealthChecks):
    """Checks whose check of ``held`` runs until ``release`` is set, past any deadline (as a
    check would if something in it ignored its timeout); it counts the checks begun."""

    def __init__(self) -> None:
        super().__init__(LOOPBACK, TIMEOUT_S, lookup_threads=2)
        self.release = asyncio.Event()
        self.begun: list[str] = []

    def release_held(self) -> None:
        self._loop.call_soon_threadsafe(self.release.set)

    async def check(self, agent: RemoteAgent) -> bool:
        self.begun.append(agent.agent_id)
        if agent.agent_id == "held":
            await self.release.wait()
            return True
        return await super().check(agent)


def test_given_a_check_still_running_expect_no_new_one_and_only_its_agent_failed() -> None:
    health = HeldChecks()
    try:
        with Receiver() as healthy:
            agents = [agent("held", "http://127.0.0.1:9/run"), agent("healthy", healthy.url)]
            # When three rounds pass while the held check runs
            rounds = [health.run(agents) for _ in range(3)]
            # Then it was begun once, failed each round, and the other agent passed each round
            assert rounds == [{"held": False, "healthy": True}] * 3
            assert health.begun.count("held") == 1
            assert health.begun.count("healthy") == 3
            # And once it ends, a round checks the agent again
            health.release_held()
            eventually(lambda: health.run(agents), "a round to pass", 5, 0.02, lambda o: o["held"])
            assert health.begun.count("held") == 2
    finally:
        health.close()


def test_given_a_name_the_guard_refuses_on_the_connections_lookup_expect_no_connection() -> None:
    """DNS rebinding: the name looked fine once (here, to the guard's own resolver), but the
    lookup the connection makes gives a loopback address agents may not use."""
    looked_public = Guard(allow=[], resolver=lambda host, port: ["93.184.216.34"])
    with Receiver() as loopback, checks(looked_public) as health:
        url = f"http://localhost:{loopback.port}/run"
        assert health.run([agent("rebound", url)]) == {"rebound": False}
        assert loopback.requests == []


def test_given_a_name_or_address_the_guard_allows_expect_the_check_made() -> None:
    with Receiver() as loopback, checks(LOOPBACK) as health:
        by_name = agent("by-name", f"http://localhost:{loopback.port}/run")
        by_address = agent("by-address", loopback.url)
        assert health.run([by_name, by_address]) == {"by-name": True, "by-address": True}
        assert [r.path for r in loopback.requests] == ["/healthz", "/healthz"]


def test_given_an_address_the_guard_refuses_in_the_url_expect_no_connection() -> None:
    with Receiver() as loopback, checks(Guard(allow=[])) as health:
        assert health.run([agent("literal", loopback.url)]) == {"literal": False}
        assert loopback.requests == []


def test_given_a_card_whose_interface_the_guard_refuses_expect_a_failure() -> None:
    """Every call to it would fail ``endpoint_not_allowed``: it must not stay routed."""
    elsewhere = {**CALLABLE, "url": "http://10.0.0.7/rpc"}
    with (
        Server(functools.partial(card_in_pieces, interface=elsewhere)) as refused,
        Server(card_in_pieces) as callable_card,
        checks() as health,
    ):
        outcomes = health.run(
            [
                agent("refused", f"{refused.origin}/card", A2A),
                agent("callable", f"{callable_card.origin}/card", A2A),
            ]
        )
    assert outcomes == {"refused": False, "callable": True}


class NeverAnswersFor:
    """A resolver standing in for a name server that never answers for ``host`` (until the
    test releases it), and gives loopback for any other name; it notes each name asked."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.release = threading.Event()
        self.asked: list[str] = []

    def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append(host)
        if host == self.host:
            self.release.wait(30)
        return ["127.0.0.1"]


def test_given_a_card_naming_a_host_that_never_resolves_expect_every_round_to_pass() -> None:
    """Reading a card's interface looked its name up in a thread of the checks' pool, which
    the deadline stopped waiting for but never freed: one more thread held each round, until
    no check that needed one could pass and healthy agents went offline. The bridge reads a
    card's interface by its form alone; each connection it makes checks its own lookup."""
    tarpit = NeverAnswersFor("tarpit.example")
    at_tarpit = {**CALLABLE, "url": "http://tarpit.example/rpc"}
    with (
        Server(functools.partial(card_in_pieces, interface=at_tarpit)) as tarpit_card,
        Server(card_in_pieces) as healthy_card,
        checks(Guard(allow=["127.0.0.0/8"], resolver=tarpit)) as health,
    ):
        agents = [
            agent("tarpit", f"{tarpit_card.origin}/card", A2A),
            agent("healthy", f"{healthy_card.origin}/card", A2A),
        ]
        try:
            # When more rounds pass than the checks have lookup threads
            rounds = [health.run(agents) for _ in range(5)]
        finally:
            tarpit.release.set()
    # Then the healthy agent passed each round; so did the other, whose calls' connections
    # check their own lookups; and no check asked for a lookup of its own
    assert [r["healthy"] for r in rounds] == [True] * 5
    assert [r["tarpit"] for r in rounds] == [True] * 5
    assert tarpit.asked == []
