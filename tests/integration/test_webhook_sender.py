"""The webhook sender against real HTTP(S) servers on loopback: it connects only to the
address the guard checked, never follows a redirect, caps what it reads, and checks TLS
against the host name, not the IP it connects to."""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Iterator

import pytest
import trustme

from broker.webhooks import policy
from broker.webhooks.ssrf import Guard
from tests.eventually import eventually
from tests.integration.receiver import Receiver, Reply, Tarpit, always
from workers.system.sender import SENDER_ERROR, send

BODY = b'{"type":"task.succeeded"}'


def post(guard: Guard, url: str, **kwargs: object) -> policy.Outcome:
    options: dict[str, object] = {"timeout_s": 5.0, "max_bytes": 4096, **kwargs}
    return send(guard, url, BODY, {"webhook-id": "msg_1"}, **options)  # type: ignore[arg-type]


class FlippingResolver:
    """Answers with ``first`` once, then with ``later``: a DNS rebinding attacker."""

    def __init__(self, first: str, later: str) -> None:
        self.first, self.later, self.calls = first, later, 0

    def __call__(self, host: str, port: int) -> list[str]:
        self.calls += 1
        return [self.first if self.calls == 1 else self.later]


def test_given_dns_that_changes_after_the_check_expect_the_checked_address_only() -> None:
    with Receiver(host="127.0.0.2") as canary, Receiver(port=canary.port) as receiver:
        resolver = FlippingResolver("127.0.0.1", "127.0.0.2")
        guard = Guard(["127.0.0.1"], resolver=resolver)

        outcome = post(guard, f"http://rebind.test:{receiver.port}/hook")

        assert outcome.status_code == 200 and outcome.address == "127.0.0.1"
        assert resolver.calls == 1
        assert receiver.requests[0].headers["host"] == f"rebind.test:{receiver.port}"
        assert canary.requests == []


def test_given_a_name_resolving_to_a_private_address_expect_no_connection() -> None:
    with Receiver(host="127.0.0.2") as canary:
        guard = Guard(["127.0.0.1"], resolver=lambda host, port: ["127.0.0.2"])

        outcome = post(guard, f"http://internal.test:{canary.port}/hook")

        assert outcome.status_code is None and not outcome.transient
        assert outcome.error is not None and outcome.error.startswith("url_not_allowed")
        assert canary.requests == []


def test_given_a_redirect_expect_it_is_not_followed() -> None:
    with Receiver() as canary:
        redirect = Reply(302, {"Location": canary.url})
        with Receiver(always(redirect)) as receiver:
            outcome = post(Guard(["127.0.0.1"]), receiver.url)

        assert outcome.status_code == 302
        assert policy.verdict(outcome) == "failed"
        assert canary.requests == []


@pytest.fixture
def endless_body_server() -> Iterator[int]:
    """Announces a 1 GiB body and sends until the client hangs up."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1073741824\r\n\r\n")
        try:
            while True:
                conn.sendall(b"x" * 65536)
        except OSError:
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    yield listener.getsockname()[1]
    listener.close()


def test_given_an_endless_response_expect_the_read_stops_at_the_cap(
    endless_body_server: int,
) -> None:
    url = f"http://127.0.0.1:{endless_body_server}/hook"

    outcome = post(Guard(["127.0.0.1"]), url, max_bytes=100_000)

    # Reading it all would end in the 5 s timeout, an error; the cap ends it with the status.
    assert outcome.status_code == 200 and outcome.error is None
    assert outcome.excerpt == "x" * 512


def test_given_a_receiver_dribbling_its_headers_expect_the_attempt_cut_at_its_timeout() -> None:
    # Given a receiver that sends its headers a byte every 0.2 s for 20 s: every read gets
    # data long before the per-read timeout, so only a bound on the whole attempt can end it
    with Tarpit(drip_s=0.2, hold_s=20) as tarpit:
        # When an attempt with a 2 s timeout is made
        outcome = post(Guard(["127.0.0.1"]), tarpit.url, timeout_s=2.0, max_bytes=1_000_000)
        eventually(lambda: tarpit.open_count == 0, "the tarpit to see the connection end")
        [held] = tarpit.held
    # Expect a timeout, retried, and the sender to have hung up while the tarpit still held
    # the connection (it was not let go after the tarpit's 20 s)
    assert outcome.status_code is None and outcome.error is not None
    assert outcome.error.startswith("timeout") and policy.verdict(outcome) == "retry"
    assert held.cut_by_client


def test_given_a_name_server_that_never_answers_expect_the_attempt_cut_at_its_timeout() -> None:
    # Given a host name whose lookup hangs until the test releases it
    released = threading.Event()
    answered = threading.Event()

    def hanging(host: str, port: int) -> list[str]:
        released.wait(30)
        answered.set()
        return ["127.0.0.1"]

    try:
        # When an attempt with a 2 s timeout is made
        outcome = post(Guard([], resolver=hanging), "http://hangs.test/hook", timeout_s=2.0)
        # Expect it back while the lookup still hangs: it did not wait for the name server
        assert not answered.is_set()
    finally:
        released.set()
    # And a DNS failure, retried
    assert outcome.error is not None and outcome.error.startswith("dns:")
    assert policy.verdict(outcome) == "retry"


def test_given_nobody_listening_expect_a_transient_connect_error() -> None:
    with socket.create_server(("127.0.0.1", 0)) as reserved:
        port = reserved.getsockname()[1]
    outcome = post(Guard(["127.0.0.1"]), f"http://127.0.0.1:{port}/hook")

    assert outcome.status_code is None and outcome.error is not None
    assert outcome.error.startswith("connect:") and policy.verdict(outcome) == "retry"


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def tls_server(ca: trustme.CA, name: str, seen: list[str]) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(name).configure_cert(context)
    context.sni_callback = lambda sock, server_name, ctx: seen.append(server_name) and None
    return context


def test_given_https_expect_sni_and_certificate_checked_on_the_host_name(ca: trustme.CA) -> None:
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    seen: list[str] = []
    with Receiver(tls=tls_server(ca, "hooks.test", seen)) as receiver:
        guard = Guard(["127.0.0.1"], resolver=lambda host, port: ["127.0.0.1"])

        outcome = post(guard, f"https://hooks.test:{receiver.port}/hook", verify=client_context)

    assert outcome.status_code == 200, outcome.error
    assert seen == ["hooks.test"]


def test_given_a_certificate_for_another_name_expect_the_attempt_fails(ca: trustme.CA) -> None:
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    with Receiver(tls=tls_server(ca, "other.test", [])) as receiver:
        guard = Guard(["127.0.0.1"], resolver=lambda host, port: ["127.0.0.1"])

        outcome = post(guard, f"https://hooks.test:{receiver.port}/hook", verify=client_context)

    assert outcome.status_code is None
    assert outcome.error is not None and "certificate" in outcome.error.lower()
    assert receiver.requests == []


def test_given_an_error_of_the_senders_own_expect_the_url_logged_without_its_query(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Receivers put their tokens in the query (``?token=...``) and the path (Slack's hooks):
    a log line is no place for them. A resolver that fails in a way the sender does not
    foresee stands for any bug."""

    def broken(host: str, port: int) -> list[str]:
        raise RuntimeError("a resolver's bug")

    with caplog.at_level("ERROR", logger="reach.webhooks"):
        url = "http://hooks.test:8080/services/T0/B0/s3cr3t?token=s3cr3t#x"
        outcome = post(Guard(["127.0.0.1"], resolver=broken), url)

    assert (outcome.error, outcome.transient) == (SENDER_ERROR, False)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "reach.webhooks"]
    assert line == "webhook attempt to http://hooks.test:8080 failed in the sender"
