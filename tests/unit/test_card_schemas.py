"""A card's schemas: every reference resolves within them when declared, nothing is ever
fetched, and a check that cannot be computed is a refusal (``broker.registry.schemas``)."""

from __future__ import annotations

import socket
from typing import Any

import pytest
from jsonschema.exceptions import SchemaError

from broker.registry import schemas
from broker.registry.model import Card

RESOLVED: list[Any] = [
    {"$defs": {"n": {"type": "integer"}}, "properties": {"a": {"$ref": "#/$defs/n"}}},
    {"$defs": {"n": {"$anchor": "num", "type": "integer"}}, "properties": {"a": {"$ref": "#num"}}},
    {"properties": {"a": {"$ref": "#"}}},
    # a nested $id is a base of its own
    {
        "$id": "https://agents.example/s.json",
        "$defs": {"n": {"$id": "n.json", "type": "integer"}},
        "properties": {"a": {"$ref": "n.json"}},
    },
    # the meta-schemas jsonschema ships are known without fetching them
    {"$ref": "https://json-schema.org/draft/2020-12/schema"},
    # a value that only looks like a reference
    {"properties": {"b": {"enum": [{"$ref": "http://127.0.0.1:9/x.json"}]}}},
]
UNRESOLVED: list[Any] = [
    {"$ref": "#/$defs/nope"},
    {"$ref": "urn:nothing:here"},
    {"$dynamicRef": "#meta"},
    {"properties": {"a": {"$ref": "https://agents.example/schema.json"}}},
]


@pytest.mark.parametrize("schema", RESOLVED)
def test_given_references_within_the_schema_expect_it_accepted(schema: Any) -> None:
    schemas.check(schema)
    assert schemas.problems(schemas.validator(schema), {"a": 1}) == []


@pytest.mark.parametrize("schema", UNRESOLVED)
def test_given_a_reference_that_resolves_nowhere_here_expect_schema_error(schema: Any) -> None:
    with pytest.raises(SchemaError, match="does not resolve within the schema"):
        schemas.check(schema)
    with pytest.raises(SchemaError):
        Card(capability="text.upper", agent_id="bot", version="1.0.0", input_schema=schema)


def test_given_a_remote_reference_expect_no_connection_made_to_it() -> None:
    # a listener that would see jsonschema's own fetch of the reference
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/schema.json"
        with pytest.raises(SchemaError):
            schemas.check({"$ref": url})
        # even a validator made for one (a card stored before the check) only refuses
        with pytest.raises(schemas.PayloadUncheckable, match="Unresolvable"):
            schemas.problems(schemas.validator({"$ref": url}), {})
        with pytest.raises(BlockingIOError):
            listener.accept()


def test_given_a_number_the_check_cannot_compute_expect_it_uncheckable() -> None:
    checker = schemas.validator({"properties": {"n": {"multipleOf": 0.5}}})
    with pytest.raises(schemas.PayloadUncheckable, match="OverflowError"):
        schemas.problems(checker, {"n": 10**400})
    assert [e.message for e in schemas.problems(checker, {"n": 1.25})] == [
        "1.25 is not a multiple of 0.5"
    ]
    assert schemas.problems(checker, {"n": 3}) == []
