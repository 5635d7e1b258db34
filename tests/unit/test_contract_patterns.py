"""The patterns the OpenAPI document states agree with the checks the server runs."""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime

import pytest

from broker.db.paging import (
    CREATED_CURSOR_PATTERN,
    CURSOR_PATTERN,
    decode_created_cursor,
    decode_cursor,
    encode_created_cursor,
    encode_cursor,
)
from broker.errors import BadRequest
from broker.registry.addresses import TARGET_MAX, TARGET_PATTERN, AddressInvalid, parse_target
from broker.registry.capabilities import NAME_MAX, NAME_PATTERN, is_valid_name

NAMES = [
    "echo",
    "invoice.extract",
    "a-b_c.d9",
    "reachable.x",
    "celery",
    "celeryx.y",
    "reach",
    "reach.webhooks",
    "unacked_index",
    "x.pidbox",
    "pidbox.x",
    "x.pidboxes",
    "amq",
    "amq.x",
    "amqp.x",
    "x.amq",
    "Upper",
    "9lives",
    "a..b",
    "a.b.c.d.e.f.g.h",
    "a.b.c.d.e.f.g.h.i",
    "",
    "x" * 63,
    "x" * 64,
]


@pytest.mark.parametrize("name", NAMES)
def test_the_documented_capability_pattern_is_the_server_rule(name: str) -> None:
    documented = len(name) <= NAME_MAX and re.search(NAME_PATTERN, name) is not None
    assert documented == is_valid_name(name)


TARGETS = [
    "invoice-extractor@2.3.1",
    "invoice-extractor@canary",
    "agent://acme/invoice-extractor@stable",
    "agent:///x@1",
    "agent://a/b/c@1",
    "x@",
    "@1",
    "X@1",
    "x@Canary",
    "x@1.0+build_7",
    "x",
]


@pytest.mark.parametrize("target", TARGETS)
def test_the_documented_target_pattern_is_the_server_rule(target: str) -> None:
    documented = len(target) <= TARGET_MAX and re.search(TARGET_PATTERN, target) is not None
    try:
        parse_target(target)
        parsed = True
    except AddressInvalid:
        parsed = False
    assert documented == parsed


def test_a_cursor_this_api_issued_matches_the_documented_pattern() -> None:
    cursor = encode_cursor(uuid.uuid4())
    assert re.fullmatch(CURSOR_PATTERN, cursor)
    assert decode_cursor(cursor)


@pytest.mark.parametrize("cursor", ["", "abc", "A" * 21 + "!", "A" * 23, "A" * 22 + "\n"])
def test_a_cursor_off_the_documented_pattern_is_refused(cursor: str) -> None:
    with pytest.raises(BadRequest) as refused:
        decode_cursor(cursor)
    assert refused.value.code == "invalid_cursor"


def test_a_created_cursor_this_api_issued_matches_the_documented_pattern() -> None:
    at = datetime(2026, 12, 1, 10, 39, 40, 71325, tzinfo=UTC)
    cursor = encode_created_cursor(at, "sess_Ab-_9zQ")
    assert re.fullmatch(CREATED_CURSOR_PATTERN, cursor)
    assert decode_created_cursor(cursor) == (at, "sess_Ab-_9zQ")


@pytest.mark.parametrize(
    "cursor", ["A" * 12, "_" * 12, "-" * 139, "AAAAAAAAAAA" + "sess_x", "z" * 11 + "Z"]
)
def test_every_string_of_the_created_cursor_pattern_decodes(cursor: str) -> None:
    # A client's well-formed cursor is never refused (schemathesis holds the API to that).
    at, last_id = decode_created_cursor(cursor)
    assert at.tzinfo is not None
    assert last_id == cursor[11:]


@pytest.mark.parametrize("cursor", ["", "A" * 11, "A" * 140, "A" * 11 + "sess!", "A" * 12 + "\n"])
def test_a_created_cursor_off_the_documented_pattern_is_refused(cursor: str) -> None:
    with pytest.raises(BadRequest) as refused:
        decode_created_cursor(cursor)
    assert refused.value.code == "invalid_cursor"


def test_an_id_outside_the_cursor_alphabet_is_not_encoded() -> None:
    with pytest.raises(ValueError):
        encode_created_cursor(datetime.now(UTC), "sess a")
