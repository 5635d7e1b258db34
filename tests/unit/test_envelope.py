"""Unit tests for the envelope of POST /tasks: what is accepted and how refusals are reported."""

from typing import Any

import pytest

from broker.errors import BadRequest, InvalidEnvelope
from broker.tasks.envelope import Envelope, parse_envelope

MINIMAL: dict[str, Any] = {"capability": "invoice.extract", "payload": {}}
FULL: dict[str, Any] = {
    "capability": "invoice.extract",
    "payload": {"file_url": "s3://demo/1.pdf"},
    "reply_mode": "async",
    "deadline_ms": 45000,
    "idempotency_key": "order-7731-extract",
    "session_id": "sess_7f3d92",
    "priority": 5,
    "max_attempts": 3,
    "source": "billing-service",
    "metadata": {"order": "7731"},
}
SECRET = "sk_live_9f8e7d6c5b4a_TOPSECRET"


def errors_of(data: Any) -> list[dict[str, str]]:
    with pytest.raises(InvalidEnvelope) as caught:
        parse_envelope(data)
    return caught.value.details["errors"]


def fields_of(data: Any) -> set[str]:
    return {e["field"] for e in errors_of(data)}


# --- accepted ------------------------------------------------------------------------------


def test_given_the_minimal_envelope_expect_defaults_filled_in() -> None:
    envelope = parse_envelope(MINIMAL)
    assert envelope.capability == "invoice.extract"
    assert envelope.payload == {}
    assert envelope.reply_mode == "async"
    assert envelope.deadline_ms is None
    assert envelope.idempotency_key is None
    assert envelope.priority is None
    assert envelope.max_attempts is None
    assert envelope.callback is None
    assert envelope.metadata == {}


def test_given_the_full_design_envelope_expect_every_field_kept() -> None:
    envelope = parse_envelope(FULL)
    assert isinstance(envelope, Envelope)
    assert envelope.model_dump(exclude_unset=True) == FULL


def test_given_a_callback_expect_default_events() -> None:
    envelope = parse_envelope({**MINIMAL, "callback": {"url": "https://example.test/hook"}})
    assert envelope.callback is not None
    assert envelope.callback.events == ["task.succeeded", "task.failed"]


@pytest.mark.parametrize("reply_mode", ["async", "sync", "stream"])
def test_given_each_reply_mode_expect_accepted(reply_mode: str) -> None:
    assert parse_envelope({**MINIMAL, "reply_mode": reply_mode}).reply_mode == reply_mode


@pytest.mark.parametrize("priority", [0, 9])
def test_given_priority_at_the_bounds_expect_accepted(priority: int) -> None:
    assert parse_envelope({**MINIMAL, "priority": priority}).priority == priority


# --- refused -------------------------------------------------------------------------------


@pytest.mark.parametrize("body", [[], [MINIMAL], "invoice.extract", 42, None, True])
def test_given_a_body_that_is_not_an_object_expect_invalid_envelope(body: Any) -> None:
    with pytest.raises(InvalidEnvelope) as caught:
        parse_envelope(body)
    assert caught.value.code == "envelope_invalid"
    assert isinstance(caught.value, BadRequest)


def test_given_an_unknown_field_expect_it_named_in_the_errors() -> None:
    assert fields_of({**MINIMAL, "colour": "blue"}) == {"colour"}


def test_given_an_unknown_field_in_the_callback_expect_its_path_named() -> None:
    body = {**MINIMAL, "callback": {"url": "https://example.test/hook", "secret": "x"}}
    assert fields_of(body) == {"callback.secret"}


@pytest.mark.parametrize(
    "capability",
    ["", "Invoice.Extract", "invoice..extract", "reach.janitor", "a.b.c.d.e.f.g.h.i", "x" * 129],
)
def test_given_a_bad_capability_name_expect_capability_named(capability: str) -> None:
    assert fields_of({**MINIMAL, "capability": capability}) == {"capability"}


@pytest.mark.parametrize("capability", ["unacked", "unacked_mutex", "celery", "celeryev.x"])
def test_given_a_reserved_capability_expect_an_error_saying_reserved(capability: str) -> None:
    [error] = errors_of({**MINIMAL, "capability": capability})
    assert error["field"] == "capability"
    assert "reserved" in error["message"]


@pytest.mark.parametrize("priority", [-1, 10, 100])
def test_given_priority_out_of_range_expect_priority_named(priority: int) -> None:
    assert fields_of({**MINIMAL, "priority": priority}) == {"priority"}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("deadline_ms", 0),
        ("deadline_ms", 7 * 24 * 3600 * 1000 + 1),
        ("max_attempts", 0),
        ("max_attempts", 21),
        ("reply_mode", "later"),
        ("idempotency_key", ""),
        ("idempotency_key", "has space"),
        ("session_id", "x" * 129),
        ("payload", [1, 2]),
        ("metadata", "order"),
        ("result_ttl_s", 0),
    ],
)
def test_given_a_field_out_of_its_rules_expect_that_field_named(field: str, value: Any) -> None:
    assert fields_of({**MINIMAL, field: value}) == {field}


def test_given_missing_required_fields_expect_each_named() -> None:
    assert fields_of({}) == {"capability", "payload"}


def test_given_several_problems_expect_every_one_listed() -> None:
    body = {"capability": "Bad", "payload": {}, "priority": 10, "extra": 1}
    errors = errors_of(body)
    assert {e["field"] for e in errors} == {"capability", "priority", "extra"}
    assert all(set(e) == {"field", "message"} and e["message"] for e in errors)


@pytest.mark.parametrize(
    "body",
    [
        {**MINIMAL, "idempotency_key": f"{SECRET} with spaces"},
        {**MINIMAL, "capability": SECRET},
        {**MINIMAL, "reply_mode": SECRET},
        {**MINIMAL, "priority": SECRET},
        {**MINIMAL, "session_id": SECRET * 10},
        {**MINIMAL, "callback": {"url": SECRET, "events": SECRET}},
        {**MINIMAL, "payload": SECRET},
    ],
)
def test_given_a_secret_looking_value_expect_it_never_echoed_in_the_errors(body: Any) -> None:
    with pytest.raises(InvalidEnvelope) as caught:
        parse_envelope(body)
    assert caught.value.details["errors"]
    assert "TOPSECRET" not in repr(caught.value.details)
    assert "TOPSECRET" not in str(caught.value)
