"""Unit tests for trace ids: taken from traceparent or X-Trace-Id when well formed, else new;
passed on in a traceparent of our own."""

import json
import re
import uuid

import pytest

from broker.observability.tracing import new_trace_id, trace_id_from, traceparent

HEX32 = re.compile(r"[0-9a-f]{32}")
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
OTHER = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE}-00f067aa0ba902b7-01"


def is_new_id(value: str, *not_these: str | None) -> bool:
    return HEX32.fullmatch(value) is not None and value not in not_these


# --- traceparent ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "traceparent",
    [
        TRACEPARENT,
        f"00-{TRACE}-00f067aa0ba902b7-00",
        f"  {TRACEPARENT}\t",
        f"01-{TRACE}-00f067aa0ba902b7-01",  # a later version
        f"01-{TRACE}-00f067aa0ba902b7-01-what-it-adds",  # may add fields after the flags
    ],
)
def test_given_a_well_formed_traceparent_expect_its_trace_id(traceparent: str) -> None:
    assert trace_id_from(traceparent, None) == TRACE


@pytest.mark.parametrize(
    "traceparent",
    [
        f"00-{'0' * 32}-00f067aa0ba902b7-01",  # the all-zero trace id is invalid
        f"00-{TRACE}-00f067aa0ba902b7",  # missing flags
        f"00-{TRACE[:-1]}-00f067aa0ba902b7-01",  # 31 hex digits
        f"00-{TRACE}0-00f067aa0ba902b7-01",  # 33 hex digits
        f"00-{TRACE[:-1]}g-00f067aa0ba902b7-01",  # not hex
        f"00_{TRACE}_00f067aa0ba902b7_01",
        f"0-{TRACE}-00f067aa0ba902b7-01",
        f"00-{TRACE}-00f067aa0ba902b7-01-extra",  # version 00 has exactly four fields
        TRACEPARENT.upper(),  # W3C: lowercase only (OpenTelemetry refuses it too)
        f"ff-{TRACE}-00f067aa0ba902b7-01",  # version ff is invalid
        f"00-{TRACE}-{'0' * 16}-01",  # so is the all-zero parent id
        f"01-{TRACE}-00f067aa0ba902b7-01extra",  # a later version's fields follow a dash
        TRACE,
        "garbage",
        "",
    ],
)
def test_given_a_malformed_traceparent_expect_a_new_trace_id(traceparent: str) -> None:
    got = trace_id_from(traceparent, None)
    assert is_new_id(got, TRACE, "0" * 32)


def test_given_a_malformed_traceparent_and_a_good_x_trace_id_expect_the_x_trace_id() -> None:
    assert trace_id_from("garbage", OTHER) == OTHER
    assert trace_id_from(f"00-{'0' * 32}-00f067aa0ba902b7-01", OTHER) == OTHER


# --- X-Trace-Id ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (OTHER, OTHER),
        (OTHER.upper(), OTHER),
        (f" {OTHER} ", OTHER),
        ("0af76519-16cd-43dd-8448-eb211c80319c", OTHER),  # dashed UUID form
        ("0AF76519-16CD-43DD-8448-EB211C80319C", OTHER),
    ],
)
def test_given_a_well_formed_x_trace_id_expect_it_normalised(header: str, expected: str) -> None:
    assert trace_id_from(None, header) == expected


@pytest.mark.parametrize(
    "header",
    [
        "hello",
        "'; drop table tasks; --",
        OTHER[:-1],
        OTHER + "0",
        OTHER[:-1] + "z",
        "0" * 32,
        "00000000-0000-0000-0000-000000000000",
        "<script>alert(1)</script>",
        "",
    ],
)
def test_given_a_junk_x_trace_id_expect_it_replaced_by_a_new_one(header: str) -> None:
    got = trace_id_from(None, header)
    assert is_new_id(got, header, header.lower(), "0" * 32)


# --- precedence and new ids ----------------------------------------------------------------


def test_given_both_headers_well_formed_expect_traceparent_to_win() -> None:
    assert trace_id_from(TRACEPARENT, OTHER) == TRACE


def test_given_no_headers_expect_a_new_32_hex_trace_id() -> None:
    assert HEX32.fullmatch(trace_id_from(None, None))
    assert HEX32.fullmatch(trace_id_from("", ""))


def test_given_no_headers_twice_expect_distinct_trace_ids() -> None:
    assert trace_id_from(None, None) != trace_id_from(None, None)


def test_given_many_new_trace_ids_expect_all_32_hex_and_distinct() -> None:
    ids = [new_trace_id() for _ in range(1000)]
    assert all(HEX32.fullmatch(i) for i in ids)
    assert len(set(ids)) == len(ids)


# --- traceparent we send -------------------------------------------------------------------


def test_given_a_trace_id_expect_a_traceparent_that_reads_back_as_it() -> None:
    sent = traceparent(TRACE)
    assert re.fullmatch(rf"00-{TRACE}-[0-9a-f]{{16}}-01", sent)
    assert trace_id_from(sent, None) == TRACE


def test_given_two_traceparents_of_one_trace_expect_distinct_parent_span_ids() -> None:
    assert traceparent(TRACE) != traceparent(TRACE)


def test_a_run_message_carries_its_trace_as_a_traceparent_too() -> None:
    """OpenTelemetry's Celery instrumentation continues the trace a message's ``traceparent``
    names: without one, each worker span began a trace of its own."""
    from celery import Celery

    from broker.tasks.dispatch import TENANT_HEADER, redis_run_message

    app = Celery("t", set_as_current=False, broker="redis://127.0.0.1:1/0")
    trace_id = new_trace_id()
    _, raw = redis_run_message(
        app, uuid.uuid4(), "echo", trace_id=trace_id, tenant="acme", deadline_at=None
    )
    headers = json.loads(raw)["headers"]
    assert (headers["trace_id"], headers[TENANT_HEADER]) == (trace_id, "acme")
    assert trace_id_from(headers["traceparent"], None) == trace_id
