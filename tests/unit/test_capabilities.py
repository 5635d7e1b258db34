"""Unit tests for capability names, key patterns and the routing prefix chain."""

import uuid

import pytest
from celery import Celery
from celery.events.event import EVENT_EXCHANGE_NAME
from kombu import pidbox
from kombu.transport.redis import Channel

from broker.registry.capabilities import (
    NAME_MAX,
    any_pattern_allows,
    is_reserved,
    is_valid_name,
    is_valid_pattern,
    pattern_allows,
    pattern_covers,
    patterns_cover,
    prefix_chain,
)

# --- is_valid_name -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "invoice",
        "invoice.extract",
        "invoice.extract.zh",
        "a",
        "a1",
        "pdf_to-text.v2",
        "x" * 63,
        "a.b.c.d.e.f.g.h",  # eight segments: the limit
        "reachable",  # only the exact `reach` segment is reserved
        "reach_x.y",
        "my.reach",
    ],
)
def test_given_dotted_lowercase_segments_expect_a_valid_name(name: str) -> None:
    assert is_valid_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "",
        "Invoice",
        "invoice.Extract",
        "INVOICE",
        "1invoice",
        "invoice.2x",
        "_invoice",
        "-invoice",
        "invoice.",
        ".invoice",
        "invoice..extract",
        "invoice extract",
        "invoice/extract",
        "invoice*",
        "*",
        "invoice.*",
        "x" * 64,  # a segment is at most 63 characters
        "a.b.c.d.e.f.g.h.i",  # nine segments
        "invoice\n",
        "ïnvoice",
    ],
)
def test_given_a_malformed_name_expect_it_invalid(name: str) -> None:
    assert not is_valid_name(name)


@pytest.mark.parametrize("name", ["reach", "reach.janitor", "reach.x.y"])
def test_given_a_name_under_the_reserved_prefix_expect_reserved_and_invalid(name: str) -> None:
    assert is_reserved(name)
    assert not is_valid_name(name)


@pytest.mark.parametrize("name", ["reachable", "reach_x", "my.reach", "invoice"])
def test_given_a_name_outside_the_reserved_prefix_expect_not_reserved(name: str) -> None:
    assert not is_reserved(name)


@pytest.mark.parametrize(
    "name",
    [
        "unacked",
        "unacked_index",
        "unacked_mutex",
        "unacked_restore",  # a key a later kombu may add under the same stem
        "celery",
        "celeryev",
        "celeryev.a1b2c3",
        "celery-task-meta-a1b2c3",
        "celery.pidbox",
        "a1b2c3.reply.celery.pidbox",
        "invoice.pidbox",
        "amq",  # RabbitMQ refuses to declare a queue named amq.…
        "amq.gen-x",
        "amq.probe",
    ],
)
def test_given_a_name_celery_or_kombu_keep_a_key_under_expect_reserved_and_invalid(
    name: str,
) -> None:
    assert is_reserved(name)
    assert not is_valid_name(name)


@pytest.mark.parametrize(
    "name",
    ["celeriac", "invoice.celery", "unack", "text.unacked", "pidboxes", "acked", "amqp", "x.amq"],
)
def test_given_a_name_only_resembling_a_foreign_key_expect_valid(name: str) -> None:
    assert is_valid_name(name)


def test_given_the_keys_kombus_redis_transport_keeps_expect_no_valid_name_spells_one() -> None:
    keys = [
        Channel.unacked_key,
        Channel.unacked_index_key,
        Channel.unacked_mutex_key,
        Channel.keyprefix_queue % "invoice",
        Channel.keyprefix_binding_deadlines,
        Channel.keyprefix_binding_permanent % "invoice",
        f"invoice{Channel.sep}{Channel.priority_steps[-1]}",  # a priority queue's list
    ]
    assert [k for k in keys if is_valid_name(k)] == []


def test_given_the_queues_celery_declares_itself_expect_no_valid_name_spells_one() -> None:
    app = Celery("names", set_as_current=False)
    mailbox = pidbox.Mailbox("celery", type="fanout")
    oid = "a" + uuid.uuid4().hex  # a reply queue's oid can start with a letter
    queues = [
        app.conf.task_default_queue,
        f"{EVENT_EXCHANGE_NAME}.{oid}",
        f"{oid}.{mailbox.reply_exchange.name}",
        f"{oid}.{mailbox.namespace}.pidbox",
        f"celery-task-meta-{oid}",
    ]
    assert [q for q in queues if is_valid_name(q)] == []


def test_given_a_name_of_exactly_name_max_characters_expect_valid() -> None:
    name = "a" * 63 + "." + "b" * 62 + "." + "c"
    assert len(name) == NAME_MAX
    assert is_valid_name(name)


def test_given_a_name_one_over_name_max_with_valid_segments_expect_invalid() -> None:
    name = "a" * 63 + "." + "b" * 63 + "." + "c"
    assert len(name) == NAME_MAX + 1
    assert not is_valid_name(name)


# --- is_valid_pattern ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "pattern",
    ["*", "invoice", "invoice.*", "invoice.extract", "invoice.extract.*", "a.b.c.*"],
)
def test_given_a_well_formed_pattern_expect_valid(pattern: str) -> None:
    assert is_valid_pattern(pattern)


@pytest.mark.parametrize(
    "pattern",
    [
        "",
        "**",
        "*.invoice",
        "invoice*",
        "invoice.*.extract",
        "invoice.**",
        "Invoice.*",
        "invoice.",
        ".*",
        "invoice..*",
        "invoice .*",
        "x" * (NAME_MAX + 1),
    ],
)
def test_given_a_malformed_pattern_expect_invalid(pattern: str) -> None:
    assert not is_valid_pattern(pattern)


# --- pattern_allows ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["invoice", "invoice.extract", "a.b.c.d", "anything"])
def test_given_the_star_pattern_expect_every_name_allowed(name: str) -> None:
    assert pattern_allows("*", name)


@pytest.mark.parametrize("name", ["invoice", "invoice.extract", "invoice.extract.zh"])
def test_given_a_stem_wildcard_expect_the_stem_and_everything_below_allowed(name: str) -> None:
    assert pattern_allows("invoice.*", name)


@pytest.mark.parametrize(
    "name", ["invoices", "invoices.x", "invoicex.extract", "inv", "billing.invoice", "xinvoice"]
)
def test_given_a_stem_wildcard_expect_siblings_sharing_a_text_prefix_refused(name: str) -> None:
    assert not pattern_allows("invoice.*", name)


def test_given_an_exact_pattern_expect_only_that_name_allowed() -> None:
    assert pattern_allows("invoice.extract", "invoice.extract")
    assert not pattern_allows("invoice.extract", "invoice")
    assert not pattern_allows("invoice.extract", "invoice.extract.zh")
    assert not pattern_allows("invoice.extract", "invoice.extractor")


def test_given_several_patterns_expect_a_name_allowed_when_any_allows_it() -> None:
    patterns = ("billing.*", "invoice.extract")
    assert any_pattern_allows(patterns, "billing.charge")
    assert any_pattern_allows(patterns, "invoice.extract")
    assert not any_pattern_allows(patterns, "invoice.render")
    assert not any_pattern_allows([], "invoice.extract")


# --- pattern_covers and patterns_cover --------------------------------------------------


@pytest.mark.parametrize(
    ("outer", "inner"),
    [
        ("*", "*"),
        ("*", "invoice.*"),
        ("*", "invoice"),
        ("invoice.*", "invoice.*"),
        ("invoice.*", "invoice"),
        ("invoice.*", "invoice.extract"),
        ("invoice.*", "invoice.extract.*"),
        ("invoice.extract", "invoice.extract"),
    ],
)
def test_given_an_outer_pattern_allowing_all_the_inner_allows_expect_covered(
    outer: str, inner: str
) -> None:
    assert pattern_covers(outer, inner)


@pytest.mark.parametrize(
    ("outer", "inner"),
    [
        ("invoice.*", "*"),
        ("echo", "*"),
        ("invoice", "invoice.*"),  # the stem alone, not what lies below it
        ("invoice.extract", "invoice.*"),
        ("invoice.extract.*", "invoice.*"),
        ("invoice.extract.*", "invoice"),
        ("invoice.*", "invoices.*"),  # a text prefix is not a segment prefix
        ("invoice.*", "invoicex"),
        ("echo", "invoice"),
    ],
)
def test_given_an_inner_pattern_allowing_a_name_the_outer_refuses_expect_not_covered(
    outer: str, inner: str
) -> None:
    assert not pattern_covers(outer, inner)


def test_given_patterns_expect_a_filter_covered_when_each_of_its_patterns_is() -> None:
    key = ("invoice.*", "echo")
    assert patterns_cover(key, ["echo"])
    assert patterns_cover(key, ["invoice.extract", "echo"])
    assert not patterns_cover(key, ["echo", "billing.*"])


def test_given_an_empty_filter_expect_it_covered_only_by_the_star_pattern() -> None:
    # A subscription with no capability filter receives every capability's events.
    assert patterns_cover(("*",), [])
    assert not patterns_cover(("invoice.*", "echo"), [])


def test_given_narrow_patterns_expect_no_union_of_them_to_cover_a_wildcard() -> None:
    assert not patterns_cover(("invoice", "invoice.extract", "invoice.render"), ["invoice.*"])


# --- prefix_chain --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "chain"),
    [
        ("invoice", ["invoice"]),
        ("invoice.extract", ["invoice.extract", "invoice"]),
        ("invoice.extract.zh", ["invoice.extract.zh", "invoice.extract", "invoice"]),
    ],
)
def test_given_a_name_expect_its_prefix_chain_from_longest_to_shortest(
    name: str, chain: list[str]
) -> None:
    assert prefix_chain(name) == chain
