"""The response models state what the broker renders: its closed sets (statuses, states,
event types) and every field of a card, so a value or field added to the broker shows up
here as a failure, not as a document that quietly stops describing the answers."""

from __future__ import annotations

from typing import get_args

from api import schemas
from broker.registry import model, views
from broker.registry.model import Card
from broker.remote.registration import A2A, HTTP
from broker.tasks.resource import STATUSES
from broker.webhooks.events import EVENT_TYPES
from broker.webhooks.policy import DELIVERY_STATUSES

INSTANCE_STATES = (model.READY, model.NOT_READY, model.DRAINING, model.SUSPECT, model.OFFLINE)
SHOWN_WITH_A_CARD = {"lifecycle", "first_seen_at", "last_seen_at", "endpoint"}


def test_the_closed_sets_are_the_brokers() -> None:
    assert set(get_args(schemas.EventType)) == set(EVENT_TYPES)
    assert set(get_args(schemas.DeliveryStatus)) == set(DELIVERY_STATUSES)
    assert set(get_args(schemas.InstanceState)) == set(INSTANCE_STATES)
    assert set(get_args(schemas.Lifecycle)) == {*INSTANCE_STATES, views.REVOKED}
    protocols = schemas.RemoteEndpoint.model_fields["protocol"].annotation
    assert set(get_args(protocols)) == {HTTP, A2A}
    statuses = schemas.TaskResource.model_fields["status"].annotation
    assert set(get_args(statuses)) == set(STATUSES)


def test_a_card_view_has_every_field_of_a_card_document() -> None:
    # Given a card as a worker advertises it, shown with what the API adds
    document = Card.declare("invoice.extract", agent_id="inv", tags={"pdf": 0.5}).document()
    shown = {
        **document,
        "lifecycle": "ready",
        "first_seen_at": "2024-05-01T12:00:00Z",
        "last_seen_at": "2024-05-01T12:00:01Z",
    }
    # Then the model names each of its fields, and reads it as it is
    assert set(schemas.CardView.model_fields) == set(document) | SHOWN_WITH_A_CARD
    assert schemas.CardView.model_validate(shown).model_dump(exclude_unset=True) == shown
