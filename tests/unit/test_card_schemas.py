"""A card's schemas: every reference resolves within them when declared, nothing is ever
fetched, and a check that cannot be computed is a refusal (``broker.registry.schemas``)."""

from __future__ import annotations

import socket
import tracemalloc
from typing import Any

import jsonschema._keywords
import jsonschema._utils
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


INTS = {"type": "array", "items": {"type": "integer"}}
STRINGS = {"type": "array", "items": {"type": "string"}}


def optional_ints(keyword: str) -> dict[str, Any]:
    """Pydantic's ``Optional[list[Optional[int]]]``, in ``keyword``."""
    items = {keyword: [{"type": "integer"}, {"type": "null"}]}
    return {keyword: [{"type": "array", "items": items}, {"type": "null"}]}


def built(errors: list[Any]) -> int:
    """The errors in ``errors`` and, under each, in the errors of its branches."""
    return sum(1 + built(error.context) for error in errors)


def traced_peak(check: Any) -> tuple[Any, int]:
    """What ``check()`` returned, and the most memory it held while it ran."""
    tracemalloc.start()
    try:
        return check(), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("keyword", ["anyOf", "oneOf"])
def test_a_refused_choice_names_the_first_error_of_each_branch_not_all_of_them(
    keyword: str,
) -> None:
    """``Optional[list[Optional[int]]]`` refusing 330,000 empty lists built every error of
    every branch, and every one of theirs: 25 s and 2.9 GiB for a 1 MB payload."""
    checker = schemas.validator({"properties": {"xs": optional_ints(keyword)}})
    found, peak = traced_peak(lambda: schemas.problems(checker, {"xs": [[]] * 50_000}))
    assert [list(e.absolute_path) for e in found] == [["xs"]]
    assert found[0].message.endswith("is not valid under any of the given schemas")
    # the array branch: its first item, under which neither branch holds; the null branch
    (array, null) = found[0].context
    assert list(array.absolute_path) == ["xs", 0] and len(array.context) == 2
    assert null.message.endswith("is not of type 'null'")
    assert built(found) == 5
    assert peak < 2 * 2**20, f"held {peak / 2**20:.0f} MiB"
    # decided as before: a list of integers and nulls, or null, holds
    assert schemas.problems(checker, {"xs": [1, None, 2]}) == []
    assert schemas.problems(checker, {"xs": None}) == []


@pytest.mark.parametrize("keyword", ["anyOf", "oneOf"])
def test_a_payload_valid_under_a_later_branch_costs_no_errors_of_the_earlier(
    keyword: str,
) -> None:
    """A payload *valid* under ``list[int] | list[str]``, 330,000 strings: 8.3 s and
    0.9 GiB, for the errors of the ``list[int]`` branch."""
    checker = schemas.validator({"properties": {"xs": {keyword: [INTS, STRINGS]}}})
    found, peak = traced_peak(lambda: schemas.problems(checker, {"xs": [""] * 50_000}))
    assert found == []
    assert peak < 2 * 2**20, f"held {peak / 2**20:.0f} MiB"
    # [] is a list of either: anyOf holds, oneOf does not
    both = schemas.problems(checker, {"xs": []})
    expected = [] if keyword == "anyOf" else ["[] is valid under each of"]
    assert [e.message[:25] for e in both] == expected


class NotLookedUp(list[Any]):
    def __contains__(self, _: object) -> bool:
        raise AssertionError("an index or key was looked up in the list of the evaluated ones")


@pytest.mark.parametrize(
    ("schema", "payload", "unexpected", "finder"),
    [
        (
            {"prefixItems": [{}], "contains": {"type": "integer"}, "unevaluatedItems": False},
            list(range(20_000)),
            [0, "x"],
            "find_evaluated_item_indexes_by_schema",
        ),
        (
            {"patternProperties": {"^[0-9]+$": {}}, "unevaluatedProperties": False},
            {str(i): i for i in range(20_000)},
            {"0": 0, "x": 0},
            "find_evaluated_property_keys_by_schema",
        ),
    ],
    ids=["unevaluatedItems", "unevaluatedProperties"],
)
def test_what_is_unevaluated_is_found_with_each_index_or_key_looked_up_once(
    monkeypatch: pytest.MonkeyPatch, schema: Any, payload: Any, unexpected: Any, finder: str
) -> None:
    """jsonschema looked each index (key) up in a list of the evaluated ones: 20,000 items,
    40 KB of JSON, held the checker 1.5 s (20,000 keys, 2 s), and it grows as the square."""
    found = getattr(jsonschema._utils, finder)
    for module in (jsonschema._utils, jsonschema._keywords):
        monkeypatch.setattr(module, finder, lambda *args: NotLookedUp(found(*args)))
    checker = schemas.validator(schema)
    assert schemas.problems(checker, payload) == []
    [refused] = schemas.problems(checker, unexpected)
    assert refused.message.endswith("('x' was unexpected)")


def test_an_unevaluated_property_is_named_once_however_many_errors_it_holds() -> None:
    """jsonschema named the property once for each of its errors, all of them taken."""
    checker = schemas.validator({"unevaluatedProperties": STRINGS})
    found, peak = traced_peak(lambda: schemas.problems(checker, {"a": [0] * 50_000, "b": []}))
    assert [e.message for e in found] == [
        "Unevaluated properties are not valid under the given schema "
        "('a' was unevaluated and invalid)"
    ]
    assert peak < 2 * 2**20, f"held {peak / 2**20:.0f} MiB"
