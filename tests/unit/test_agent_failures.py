"""What a handler's exception tells the task's caller (its own words, never a database
statement's SQL and values), how many progress reports of a task are written, and how a
generator's stream is drained: its refused chunks raised in it, and it closed when its time
is up or its task is cancelled."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest
import sqlalchemy.exc

from broker.errors import AgentFailure
from workers.aio import CallCancelled
from workers.runner import HIDDEN, Bucket, _drain_generator, _failure
from workers.sdk.context import Context
from workers.timelimit import SoftTimeLimit

SPEC: Any = SimpleNamespace(card=SimpleNamespace(agent_id="test-agent"))
CTX: Any = SimpleNamespace(task_id=uuid.uuid4())


def test_an_agents_own_exception_is_told_in_its_own_words() -> None:
    failed = _failure(ValueError("the invoice has no total"), SPEC, CTX)

    assert failed.error["code"] == "agent_error"
    assert failed.error["message"] == "ValueError: the invoice has no total"


def test_a_database_statements_error_names_its_class_but_not_its_sql_or_values() -> None:
    refused = sqlalchemy.exc.DataError(
        "UPDATE sessions SET state=%(state)s WHERE id = %(id)s",
        {"state": "the tenant's secret", "id": "sess_1"},
        psycopg.DataError("invalid byte sequence: 0x00"),
    )

    failed = _failure(refused, SPEC, CTX)

    assert failed.error["code"] == "agent_error"
    assert failed.error["message"] == f"DataError: {HIDDEN}"


def test_a_tasks_reports_pass_a_burst_at_once_then_at_their_rate() -> None:
    now = [100.0]
    bucket = Bucket(5, 2.0, clock=lambda: now[0])

    assert [bucket.take() for _ in range(7)] == [True] * 5 + [False] * 2
    now[0] += 1.0  # two tokens back
    assert [bucket.take() for _ in range(3)] == [True, True, False]
    now[0] += 60.0  # never more than the burst
    assert sum(bucket.take() for _ in range(10)) == 5


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no words")


def test_an_exception_whose_str_raises_is_told_by_its_class() -> None:
    """Its failure raised in the runner before, and its task waited for the orphan check to
    end it ``worker_lost`` (run again, its agent idempotent)."""
    assert _failure(Unprintable(), SPEC, CTX).error == {
        "code": "agent_error",
        "message": "Unprintable: <unprintable Unprintable>",
        "retryable": False,
    }
    told = _failure(AgentFailure(Unprintable(), code="bad_input"), SPEC, CTX).error  # type: ignore[arg-type]
    assert (told["code"], told["message"]) == ("bad_input", "<unprintable Unprintable>")


def streaming(emitted: list[Any], *, cancelled: bool = False, refuse: Any = None) -> Context:
    def emit(chunk: Any) -> None:
        if chunk == refuse:
            raise ValueError(f"refused: {chunk!r}")
        emitted.append(chunk)

    return Context(
        task_id=uuid.uuid4(),
        capability="x",
        trace_id="t",
        attempt=1,
        _output_sink=emit,
        _cancel_probe=lambda: cancelled,
    )


def endless(closed: list[bool]) -> Iterator[int]:
    n = 0
    try:
        while True:
            yield n
            n += 1
    finally:
        closed.append(True)


def test_a_generator_past_its_time_is_closed_at_its_next_chunk() -> None:
    emitted: list[Any] = []
    closed: list[bool] = []
    with pytest.raises(SoftTimeLimit):
        _drain_generator(endless(closed), streaming(emitted), time.monotonic() - 1)
    assert (emitted, closed) == ([0], [True])


def test_a_cancelled_tasks_generator_is_closed_at_a_chunk() -> None:
    emitted: list[Any] = []
    closed: list[bool] = []
    with pytest.raises(CallCancelled):
        _drain_generator(endless(closed), streaming(emitted, cancelled=True), None)
    assert closed == [True]
    assert 1 <= len(emitted) < 10**7


def test_a_refused_chunk_is_raised_in_the_generator_which_may_go_on() -> None:
    def careful() -> Iterator[Any]:
        try:
            yield "too big"
        except ValueError as exc:
            yield f"caught {exc}"
        return {"done": True}

    emitted: list[Any] = []
    result = _drain_generator(careful(), streaming(emitted, refuse="too big"), None)
    assert (emitted, result) == (["caught refused: 'too big'"], {"done": True})


def test_a_refused_chunk_the_generator_does_not_catch_fails_it() -> None:
    def careless() -> Iterator[Any]:
        yield 1
        yield "too big"
        yield 3

    emitted: list[Any] = []
    with pytest.raises(ValueError, match="refused"):
        _drain_generator(careless(), streaming(emitted, refuse="too big"), None)
    assert emitted == [1]


def test_the_time_limit_coming_during_a_chunks_write_is_not_raised_in_the_generator() -> None:
    """On prefork SIGALRM raises ``SoftTimeLimit`` wherever the handler is, the runner's
    write of its chunk included: that is its time's, not a refusal of the chunk."""
    caught: list[BaseException] = []

    def catching() -> Iterator[int]:
        while True:
            try:
                yield 1
            except Exception as exc:  # a generator that catches what its yield raises
                caught.append(exc)

    def emit(chunk: Any) -> None:
        raise SoftTimeLimit("the agent ran past its time limit")

    ctx = Context(task_id=uuid.uuid4(), capability="x", trace_id="t", attempt=1, _output_sink=emit)
    with pytest.raises(SoftTimeLimit):
        _drain_generator(catching(), ctx, None)
    assert caught == []
