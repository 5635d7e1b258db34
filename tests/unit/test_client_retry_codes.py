"""A 409 ``conflict_retry`` is the one problem the API answers with a code that asks for the
same request again (README, "Errors"): the client sends it again, as it does a 503."""

from __future__ import annotations

import json

import httpx
import pytest
from reach_client import errors
from reach_client.plans import Request, Response, Sleep, send
from reach_client.retries import RetryPolicy, is_retried

POLICY = RetryPolicy(max_retries=2)
SUBMIT = Request("POST", "/tasks", body={"capability": "echo"}, headers={"Idempotency-Key": "k1"})


def problem(status: int, code: str) -> Response:
    body = json.dumps({"status": status, "code": code, "detail": "d"}).encode()
    return Response(status, httpx.Headers({"content-type": "application/problem+json"}), body)


def accepted() -> Response:
    return Response(202, httpx.Headers(), json.dumps({"task_id": "t1"}).encode())


def drive(request: Request, answers: list[Response]) -> tuple[Response | None, list[object]]:
    """``send`` against scripted answers: its answer (None when it raised) and its steps."""
    plan, steps = send(request, POLICY), []
    try:
        step = next(plan)
        while True:
            steps.append(step)
            step = plan.send(None if isinstance(step, Sleep) else answers.pop(0))
    except StopIteration as done:
        return done.value, steps


def test_a_conflict_retry_is_sent_again_with_the_same_key() -> None:
    answer, steps = drive(SUBMIT, [problem(409, "conflict_retry"), accepted()])

    assert answer is not None and answer.status == 202
    requests = [s for s in steps if isinstance(s, Request)]
    assert requests == [SUBMIT, SUBMIT]  # the very same request: its key and body
    assert [type(s) for s in steps] == [Request, Sleep, Request]


def test_a_conflict_retry_that_goes_on_raises_after_the_budget() -> None:
    answers = [problem(409, "conflict_retry") for _ in range(3)]
    with pytest.raises(errors.ConflictError) as raised:
        drive(SUBMIT, answers)

    assert raised.value.code == "conflict_retry"
    assert answers == []  # the first try and both retries


def test_another_409_is_not_sent_again() -> None:
    answers = [problem(409, "task_final"), accepted()]
    with pytest.raises(errors.ConflictError):
        drive(SUBMIT, answers)

    assert len(answers) == 1


def test_a_post_without_a_key_is_not_sent_again_even_for_conflict_retry() -> None:
    unkeyed = Request("POST", "/tasks", body={"capability": "echo"})
    answers = [problem(409, "conflict_retry"), accepted()]
    with pytest.raises(errors.ConflictError):
        drive(unkeyed, answers)

    assert len(answers) == 1


@pytest.mark.parametrize(
    ("status", "code", "retried"),
    [(409, "conflict_retry", True), (409, "task_final", False), (503, "overloaded", True)],
)
def test_is_retried_by_status_or_code(status: int, code: str, retried: bool) -> None:
    assert is_retried(status, code) is retried
