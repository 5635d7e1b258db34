"""A card's schemas: every reference resolves within them when declared, nothing is ever
fetched, and a check that cannot be computed is a refusal (``broker.registry.schemas``)."""

from __future__ import annotations

import socket
from typing import Any

import jsonschema._keywords
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


UNIQUE = {"type": "array", "uniqueItems": True}


@pytest.mark.parametrize(
    ("items", "unique"),
    [
        ([{"a": 1}, {"a": 1.0}], False),
        ([{"a": 1, "b": [1, 2]}, {"b": [1, 2], "a": 1}], False),
        ([None, None], False),
        (["x", "x"], False),
        ([1, True], True),
        ([0, False], True),
        (["1", 1], True),
        ([[1, 2], [2, 1]], True),
        ([{"a": 1}, {"a": 2}, {"b": 1}], True),
    ],
)
def test_unique_items_counts_json_values_as_json_schema_does(
    items: list[Any], unique: bool
) -> None:
    found = schemas.problems(schemas.validator(UNIQUE), items)
    assert (found == []) == unique, found


def test_unique_items_keys_each_item_once_instead_of_comparing_every_pair(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """jsonschema compares every pair of items that do not sort (objects): 4,000 distinct
    objects, 51 KB of JSON, held the API's event loop 16.5 s."""

    def pairwise(*_: Any, **__: Any) -> bool:
        raise AssertionError("jsonschema's pairwise uniqueItems check was used")

    monkeypatch.setattr(jsonschema._keywords, "uniq", pairwise)
    assert schemas.problems(schemas.validator(UNIQUE), [{"i": i} for i in range(4000)]) == []


def test_a_payload_with_many_errors_is_checked_only_as_far_as_the_errors_reported() -> None:
    """500,000 items of the wrong type, 1 MB of JSON, built half a million errors to report
    20: 13.7 s and 1.7 GiB at the peak."""
    checker = schemas.validator({"type": "array", "items": {"type": "string"}})
    taken = 0

    class Counted:
        def iter_errors(self, payload: Any) -> Any:
            nonlocal taken
            for error in checker.iter_errors(payload):
                taken += 1
                yield error

    found = schemas.problems(Counted(), [0] * 10_000)  # type: ignore[arg-type]
    assert len(found) == schemas.PROBLEMS_MAX
    assert taken == schemas.PROBLEMS_MAX
