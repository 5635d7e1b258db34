"""A submit that got no answer may still have made its task (an API that died after accepting
it). Its error carries the idempotency key it was sent with, the caller's or the one the client
made, so a submit again reaches that task instead of making a second. A caller that let the
client make the key had no way to know it. Both clients, against a real loopback server that
drops every connection unanswered."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from reach_client import AsyncReach, Reach, errors

from tests.integration.receiver import Reply, always
from tests.unit.client_loopback import DyingAPI, Loopback

LOST = always(Reply(drop=True))
RETRIES = 2


def submit(kind: str, url: str, **options: Any) -> Any:
    if kind == "sync":
        with Reach(url, "rk_test", max_retries=RETRIES) as reach:
            return reach.tasks.submit("echo", {"n": 1}, **options)

    async def in_async() -> Any:
        async with AsyncReach(url, "rk_test", max_retries=RETRIES) as reach:
            return await reach.tasks.submit("echo", {"n": 1}, **options)

    return asyncio.run(in_async())


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("wait", [False, True], ids=["async-mode", "wait"])
def test_a_submit_with_no_answer_carries_the_key_its_tries_were_sent_with(
    kind: str, wait: bool
) -> None:
    with Loopback(LOST) as api, pytest.raises(errors.APIConnectionError) as raised:
        submit(kind, api.base_url, wait=wait)

    sent = {r.headers["idempotency-key"] for r in api.requests}
    assert len(api.requests) == 1 + RETRIES
    assert sent == {raised.value.idempotency_key}


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_the_callers_own_key_is_the_one_carried(kind: str) -> None:
    with Loopback(LOST) as api, pytest.raises(errors.APIConnectionError) as raised:
        submit(kind, api.base_url, idempotency_key="order-7731")

    assert {r.headers["idempotency-key"] for r in api.requests} == {"order-7731"}
    assert raised.value.idempotency_key == "order-7731"


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_submit_the_api_took_before_it_died_says_it_went_out(kind: str) -> None:
    """Its first try reached the API, its retries were refused: the error said ``sent``
    False, the last try's, and the CLI printed no key to submit it again with."""
    with DyingAPI() as api, pytest.raises(errors.APIConnectionError) as raised:
        submit(kind, api.base_url)

    assert raised.value.sent is True
    assert raised.value.idempotency_key == api.header("idempotency-key")


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_submit_answered_with_what_the_client_cannot_read_carries_its_key(kind: str) -> None:
    unreadable = always(Reply(202, {"Content-Type": "text/html"}, b"<html>accepted</html>"))
    with Loopback(unreadable) as api, pytest.raises(errors.UnexpectedAnswerError) as raised:
        submit(kind, api.base_url)

    [request] = api.requests
    assert raised.value.idempotency_key == request.headers["idempotency-key"]


async def _cancelled_once_sent(api: Loopback) -> BaseException:
    """An async submit the server holds, cancelled by its caller once its request came."""
    async with AsyncReach(api.base_url, "rk_test", max_retries=RETRIES) as reach:
        submitting = asyncio.create_task(reach.tasks.submit("echo", {"n": 1}))
        await asyncio.to_thread(api.wait_for, 1)
        submitting.cancel()
        try:
            await submitting
        except asyncio.CancelledError as exc:
            return exc
    raise AssertionError("the submit was not cancelled")


def test_a_cancelled_submit_carries_its_key() -> None:
    """Cancelled by its caller (a TaskGroup whose sibling failed, a handler whose own client
    left) once its request went out, it may have made its task."""
    with Loopback(lambda n: api.hold()) as api:
        cancelled = asyncio.run(_cancelled_once_sent(api))
    [request] = api.requests
    assert getattr(cancelled, "idempotency_key", None) == request.headers["idempotency-key"]
