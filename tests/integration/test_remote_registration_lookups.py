"""``PUT /agents/{agent_id}`` looks host names up as the API's other routes do: in the API's
lookup threads (``HostLookups``), each within ``REACH_DNS_TIMEOUT_S``. It ran them on the
API's default thread pool with no time limit: a name server that never answers held the
request, and a thread of that pool, for as long as the resolver took.

The API here is given lookups whose resolver never answers for ``tarpit.example``."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine

from api.app import create_app
from broker.settings import Settings
from broker.tenancy import key_store
from broker.webhooks.ssrf import HostLookups
from tests.integration.conftest import client_for
from tests.integration.receiver import Receiver, Reply
from tests.integration.stack import ServedApp
from tests.unit.test_remote_a2a import card_json

TIMEOUT_S = 0.5


class NeverAnswersFor:
    """A resolver standing in for a name server that never answers for ``tarpit.example``
    (until released); an address resolves to itself. It notes each name asked."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.asked: list[str] = []

    def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append(host)
        if host == "tarpit.example":
            self.release.wait(60)
        return [host]


@pytest.fixture
def resolver() -> Iterator[NeverAnswersFor]:
    found = NeverAnswersFor()
    yield found
    found.release.set()


@pytest.fixture
def ops(settings: Settings, engine: Engine, resolver: NeverAnswersFor) -> Iterator[httpx.Client]:
    """An operator's client of an API whose lookups use ``resolver``."""
    app = create_app(settings)
    app.state.services.lookups = HostLookups(
        threads=4, timeout_s=TIMEOUT_S, per_tenant=2, resolver=resolver
    )
    _, token = key_store.create_key(engine, "ops-lookups", ["*"], is_admin=True)
    with ServedApp(app) as served, client_for(served, token) as http:
        yield http


def a2a(card_url: str) -> dict[str, Any]:
    return {
        "version": "1.0.0",
        "endpoint": {"protocol": "a2a", "url": card_url},
        "capability_prefix": "tarpit",
    }


def http(url: str) -> dict[str, Any]:
    return {
        "version": "1.0.0",
        "endpoint": {"protocol": "http", "url": url},
        "capabilities": [{"capability": "tarpit.run"}],
    }


def card_at_the_tarpit(_number: int) -> Reply:
    interface = {"url": "http://tarpit.example/rpc", "protocolBinding": "JSONRPC"}
    body = json.dumps(card_json(supportedInterfaces=[interface])).encode()
    return Reply(headers={"Content-Type": "application/json"}, body=body)


@pytest.mark.parametrize(
    "where",
    ["an http endpoint", "an a2a card's URL", "an a2a card's interface"],
)
def test_a_host_that_never_resolves_is_refused_at_the_lookup_timeout(
    ops: httpx.Client, resolver: NeverAnswersFor, where: str
) -> None:
    with Receiver(card_at_the_tarpit) as card:
        # Given a registration naming tarpit.example where ``where`` says
        body = {
            "an http endpoint": http("http://tarpit.example/run"),
            "an a2a card's URL": a2a("http://tarpit.example/.well-known/agent-card.json"),
            "an a2a card's interface": a2a(card.url),
        }[where]
        # When it is sent
        answer = ops.put("/agents/tarpit-agent", json=body)
    # Then it is refused once the lookup's time is up, saying so, and nothing is written
    assert answer.status_code == 422, answer.text
    assert answer.json()["code"] == "endpoint_not_allowed"
    assert f"did not resolve within {TIMEOUT_S:g} s" in answer.json()["detail"]
    assert resolver.asked.count("tarpit.example") == 1
    assert ops.get("/agents/tarpit-agent").status_code == 404
