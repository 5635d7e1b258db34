"""Unit tests for the agent SDK: registering capabilities and the handler's Context."""

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from jsonschema.exceptions import SchemaError

from broker.registry.model import CARD_SCHEMA_VERSION, Card, CardRef
from workers.sdk.agent import AgentRegistry
from workers.sdk.context import Context

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"file_url": {"type": "string"}},
    "required": ["file_url"],
}


def extract(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    """Pull fields out of an invoice."""
    return {"ok": True}


def other_extract(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    return {"ok": False}


# --- registering ---------------------------------------------------------------------------


def test_given_a_decorated_handler_expect_its_spec_recorded() -> None:
    registry = AgentRegistry()
    returned = registry.capability(
        "invoice.extract",
        agent_id="invoice-bot",
        version="1.2.0",
        input_schema=SCHEMA,
        timeout_s=30.0,
        idempotent=True,
        display_name="Invoice extractor",
        languages=["en", "zh"],
        cost="low",
    )(extract)

    spec = registry.get("invoice.extract")
    assert returned is extract
    assert spec is not None
    assert spec.name == "invoice.extract"
    assert spec.card.agent_id == "invoice-bot"
    assert spec.card.version == "1.2.0"
    assert spec.handler is extract
    assert spec.card.input_schema == SCHEMA
    assert spec.card.timeout_s == 30.0
    assert spec.card.idempotent is True
    assert spec.card.display_name == "Invoice extractor"
    assert spec.card.extra == {"languages": ["en", "zh"], "cost": "low"}


def test_given_no_options_expect_the_defaults() -> None:
    registry = AgentRegistry()
    registry.capability("invoice.render", agent_id="render-bot")(other_extract)
    spec = registry.get("invoice.render")
    assert spec is not None
    assert spec.card.version == "0.1.0"
    assert spec.card.idempotent is False
    assert spec.card.timeout_s is None
    assert spec.card.input_schema is None
    assert spec.card.description is None
    assert spec.card.extra == {}


def test_given_no_description_expect_the_handler_docstring() -> None:
    registry = AgentRegistry()
    registry.capability("invoice.extract", agent_id="invoice-bot")(extract)
    spec = registry.get("invoice.extract")
    assert spec is not None
    assert spec.card.description == "Pull fields out of an invoice."


def test_given_several_capabilities_expect_iteration_over_all_of_them() -> None:
    registry = AgentRegistry()
    registry.capability("invoice.extract", agent_id="a")(extract)
    registry.capability("invoice.render", agent_id="b")(other_extract)
    assert {spec.name for spec in registry} == {"invoice.extract", "invoice.render"}
    assert registry.get("invoice.missing") is None


def test_given_a_fresh_registry_expect_nothing_from_the_global_one() -> None:
    assert list(AgentRegistry()) == []


@pytest.mark.parametrize(
    "name", ["", "Invoice.Extract", "invoice..extract", "reach.janitor", "invoice.*", "a b"]
)
def test_given_an_invalid_name_expect_value_error_at_decoration_time(name: str) -> None:
    registry = AgentRegistry()
    with pytest.raises(ValueError, match="invalid capability name"):
        registry.capability(name, agent_id="bot")
    assert list(registry) == []


@pytest.mark.parametrize("name", ["unacked", "unacked_index", "celery", "celeryev.x", "x.pidbox"])
def test_given_a_name_kombu_or_celery_keep_a_key_under_expect_value_error_saying_reserved(
    name: str,
) -> None:
    registry = AgentRegistry()
    with pytest.raises(ValueError, match="reserved"):
        registry.capability(name, agent_id="bot")
    assert list(registry) == []


@pytest.mark.parametrize(
    "schema",
    [{"type": "not-a-type"}, {"type": 5}, {"required": "file_url"}, {"minLength": -1}],
)
def test_given_an_invalid_json_schema_expect_schema_error_at_decoration_time(
    schema: dict[str, Any],
) -> None:
    registry = AgentRegistry()
    with pytest.raises(SchemaError):
        registry.capability("invoice.extract", agent_id="bot", input_schema=schema)
    assert registry.get("invoice.extract") is None


def test_given_a_second_handler_for_the_same_name_expect_value_error() -> None:
    registry = AgentRegistry()
    registry.capability("invoice.extract", agent_id="first")(extract)
    with pytest.raises(ValueError, match="already served by first"):
        registry.capability("invoice.extract", agent_id="second")(other_extract)
    spec = registry.get("invoice.extract")
    assert spec is not None
    assert spec.handler is extract


def test_given_the_same_handler_registered_again_expect_no_error() -> None:
    registry = AgentRegistry()
    registry.capability("invoice.extract", agent_id="bot")(extract)
    registry.capability("invoice.extract", agent_id="bot")(extract)
    assert [spec.name for spec in registry] == ["invoice.extract"]


# --- the card document ----------------------------------------------------------------------


def test_given_declared_fields_expect_each_in_the_document_where_the_card_schema_puts_it() -> None:
    card = Card.declare(
        "invoice.extract",
        agent_id="invoice-bot",
        version="1.2.0",
        timeout_s=2.5,
        max_payload_bytes=1024,
        weight=0.05,
        tags={"pdf": 0.5},
        idempotent=True,
        max_attempts=2,
        languages=["en"],
    )
    document = card.document()
    assert document["schema_version"] == CARD_SCHEMA_VERSION
    assert (document["capability"], document["agent_id"], document["version"]) == (
        "invoice.extract",
        "invoice-bot",
        "1.2.0",
    )
    assert document["display_name"] == "invoice-bot"  # none declared: the agent's id
    assert document["constraints"] == {"max_payload_bytes": 1024, "timeout_hint_ms": 2500}
    assert document["tags"] == [
        {"tag": "invoice.extract", "weight": 0.05},
        {"tag": "pdf", "weight": 0.5},
    ]
    assert (document["idempotent"], document["max_attempts"]) == (True, 2)
    assert document["extra"] == {"languages": ["en"]}


def test_given_a_card_expect_its_lease_entry_to_route_by_its_own_fields() -> None:
    card = Card.declare("invoice.extract", agent_id="bot", version="2", weight=0.2, cost_per_call=3)
    assert card.ref() == CardRef("bot", "2", "invoice.extract", weight=0.2, cost_per_call=3)
    assert card.ref().queue() == "invoice.extract@bot@2"


def test_given_a_private_card_expect_its_instances_to_take_only_from_its_own_queues() -> None:
    # Any tenant's task may wait in the capability's queue; a card naming tenants takes only
    # what routing sent to its card (or an instance of it)
    public = CardRef("bot", "1.0.0", "text.upper")
    private = CardRef("bot", "2.0.0", "text.upper", tenants=("acme",))
    assert public.queues("w@h") == (
        "text.upper",
        "text.upper@bot@1.0.0",
        "text.upper@bot@1.0.0@w@h",
    )
    assert private.queues("w@h") == ("text.upper@bot@2.0.0", "text.upper@bot@2.0.0@w@h")


@pytest.mark.parametrize(
    "bad", [{"weight": -1}, {"cost_per_call": -0.5}, {"lease_ttl_s": 0}, {"max_attempts": 0}]
)
def test_given_an_impossible_number_expect_value_error_at_declaration(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="max_attempts >= 1"):
        Card.declare("invoice.extract", agent_id="bot", **bad)


@pytest.mark.parametrize(
    "schema", [{"type": "array"}, {"type": ["string", "null"]}, {"type": "string", "minLength": 1}]
)
def test_given_an_input_schema_no_object_passes_expect_value_error_at_declaration(
    schema: dict[str, Any],
) -> None:
    # a task's payload is a JSON object: no task could pass it, and MCP shows no such tool
    with pytest.raises(ValueError, match="input_schema must allow an object"):
        Card.declare("invoice.extract", agent_id="bot", input_schema=schema)


@pytest.mark.parametrize("schema", [{"type": ["object", "null"]}, {"properties": {}}, {}])
def test_given_an_input_schema_an_object_passes_expect_the_card(schema: dict[str, Any]) -> None:
    assert (
        Card.declare("invoice.extract", agent_id="bot", input_schema=schema).input_schema == schema
    )


# --- validator -----------------------------------------------------------------------------


def test_given_an_input_schema_expect_a_validator_that_checks_payloads() -> None:
    registry = AgentRegistry()
    registry.capability("invoice.extract", agent_id="bot", input_schema=SCHEMA)(extract)
    spec = registry.get("invoice.extract")
    assert spec is not None
    validator = spec.validator
    assert validator is not None
    assert spec.validator is validator  # built once, not per task
    assert validator.is_valid({"file_url": "s3://demo/1.pdf"})
    assert not validator.is_valid({})
    assert not validator.is_valid({"file_url": 7})
    assert [e.validator for e in validator.iter_errors({})] == ["required"]


def test_given_no_input_schema_expect_no_validator() -> None:
    registry = AgentRegistry()
    registry.capability("invoice.extract", agent_id="bot")(extract)
    spec = registry.get("invoice.extract")
    assert spec is not None
    assert spec.validator is None


# --- Context -------------------------------------------------------------------------------


def a_context(**overrides: Any) -> Context:
    fields: dict[str, Any] = {
        "task_id": uuid.uuid4(),
        "capability": "invoice.extract",
        "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736",
        "attempt": 1,
    }
    fields.update(overrides)
    return Context(**fields)


def test_given_no_deadline_expect_time_left_none() -> None:
    assert a_context().time_left_s() is None


def test_given_a_future_deadline_expect_positive_time_left_up_to_the_deadline() -> None:
    ctx = a_context(deadline_at=datetime.now(UTC) + timedelta(seconds=60))
    left = ctx.time_left_s()
    assert left is not None
    assert 55 < left <= 60


def test_given_a_past_deadline_expect_zero_time_left() -> None:
    ctx = a_context(deadline_at=datetime.now(UTC) - timedelta(seconds=5))
    assert ctx.time_left_s() == 0.0


@pytest.mark.parametrize("percent", [-0.1, -1, 100.5, 101, float("nan"), float("inf")])
def test_given_percent_outside_0_to_100_expect_value_error(percent: float) -> None:
    reported: list[dict[str, Any]] = []
    ctx = a_context(_progress_sink=reported.append)
    with pytest.raises(ValueError, match="between 0 and 100"):
        ctx.progress(percent)
    assert reported == []


@pytest.mark.parametrize("percent", [0, 42.5, 100])
def test_given_percent_in_range_expect_a_dict_passed_to_the_sink(percent: float) -> None:
    reported: list[dict[str, Any]] = []
    ctx = a_context(_progress_sink=reported.append)
    ctx.progress(percent, "reading page 3")
    assert reported == [{"percent": percent, "message": "reading page 3"}]


def test_given_no_message_expect_message_none_in_the_report() -> None:
    reported: list[dict[str, Any]] = []
    a_context(_progress_sink=reported.append).progress(10)
    assert reported == [{"percent": 10, "message": None}]


class AsyncCall:
    async def __call__(self, ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
        return {}


class AsyncStream:
    async def __call__(self, ctx: Context, payload: dict[str, Any]) -> Any:
        yield {}


class SyncCall:
    def __call__(self, ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
        return {}


async def coroutine_handler(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    return {}


@pytest.mark.parametrize(
    ("handler", "is_async", "is_async_generator"),
    [
        (extract, False, False),
        (coroutine_handler, True, False),
        (AsyncCall(), True, False),
        (AsyncStream(), True, True),
        (SyncCall(), False, False),
    ],
)
def test_a_handler_runs_on_the_loop_when_calling_it_runs_an_async_def(
    handler: Any, is_async: bool, is_async_generator: bool
) -> None:
    """An object whose ``__call__`` is an ``async def`` was taken for a sync handler."""
    registry = AgentRegistry()
    registry.capability("unit.kinds", agent_id="unit-kinds")(handler)
    spec = registry.get("unit.kinds")
    assert spec is not None
    assert (spec.is_async, spec.is_async_generator) == (is_async, is_async_generator)
