"""A payload that waits for an agent (``queue_if_unavailable`` with none live) is checked as a
routed one is: against the cards whose instances would take it from its queue."""

from __future__ import annotations

from typing import Any

import httpx
from sqlalchemy import Engine

from api.app import create_app
from broker.registry import leases
from broker.registry.model import Card
from broker.settings import Settings
from tests.integration.conftest import KeyMaker, client_for, count_tasks
from tests.integration.stack import ServedApp

CAPABILITY = "test.nobody-checks"  # its cards are advertised here; no agent ever serves it
TEXT = {"required": ["text"], "properties": {"text": {"type": "string"}}}
NUMBER = {"required": ["n"], "properties": {"n": {"type": "integer"}}}


def test_a_waiting_payload_is_refused_unless_a_card_that_would_take_it_fits(
    engine: Engine, settings: Settings, make_key: KeyMaker
) -> None:
    """It was queued unchecked: an agent coming later failed each such task, and a payload of
    any shape sat in the queue until it did."""
    cards = [
        Card.declare(CAPABILITY, agent_id="test-checks", version=version, input_schema=schema)
        for version, schema in (("1.0.0", TEXT), ("2.0.0", NUMBER))
    ]
    leases.advertise_cards(engine, [card.document() for card in cards])
    tenant, token = make_key()
    # an API of its own: the session's has cached which capabilities were ever served
    with ServedApp(create_app(settings)) as api, client_for(api, token) as http:

        def submit(payload: dict[str, Any]) -> httpx.Response:
            envelope = {"capability": CAPABILITY, "payload": payload, "queue_if_unavailable": True}
            return http.post("/tasks", json=envelope)

        # neither card takes these: refused as the first card refuses them
        for payload in ({"text": 7}, {"text": [0] * 3000}, {}):
            refused = submit(payload)
            assert refused.status_code == 422, refused.json()
            assert refused.json()["code"] == "payload_invalid"
            fields = [e["field"] for e in refused.json()["errors"]]
            assert fields in (["payload/text"], ["payload"]), fields
        assert count_tasks(engine, tenant) == 0
        # one card or the other takes these: they wait in the capability's queue
        for payload in ({"text": "a"}, {"n": 1}):
            waiting = submit(payload)
            assert waiting.status_code == 202, waiting.json()
            assert http.get(f"/tasks/{waiting.json()['task_id']}").json()["status"] == "queued"
