"""A write the server may have applied is not sent again: a session's PUT or PATCH is a
compare-and-set on ``If-Match`` and a DELETE answers 404 once it took, so a repeat after a
lost answer would report a change that succeeded as a conflict or as not found. It is sent
again only when it surely was not applied: the connection failed before it went out, or the
server refused it with 429 or 503. Both clients, against a real loopback server."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable
from typing import Any

import pytest
from reach_client import AsyncReach, Reach, errors

from tests.integration.receiver import Reply
from tests.unit.client_loopback import Loopback, problem_reply

SESSION = {"session_id": "s1", "revision": 2, "state": {"cart": ["tea"]}}
SESSION_REPLY = Reply(200, {"Content-Type": "application/json"}, json.dumps(SESSION).encode())
LOST = Reply(drop=True)  # applied, then the connection dropped before the answer


def update(reach: Any) -> Any:
    return reach.sessions.update("s1", {"cart": ["tea"]}, revision=1)


def patch(reach: Any) -> Any:
    return reach.sessions.patch("s1", {"state": {"cart": None}}, revision=1)


def delete_session(reach: Any) -> Any:
    return reach.sessions.delete("s1")


def delete_webhook(reach: Any) -> Any:
    return reach.webhooks.delete("w1")


WRITES = [update, patch, delete_session, delete_webhook]


def run(kind: str, url: str, write: Callable[[Any], Any]) -> Any:
    if kind == "sync":
        with Reach(url, "rk_test", max_retries=2) as reach:
            return write(reach)

    async def in_async() -> Any:
        async with AsyncReach(url, "rk_test", max_retries=2) as reach:
            return await write(reach)

    return asyncio.run(in_async())


def repeat_answer(method: str) -> Reply:
    """What the server answers a repeat of a write it applied."""
    if method == "DELETE":
        return problem_reply(404, "not_found")
    return problem_reply(412, "revision_conflict")


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("write", WRITES, ids=lambda w: w.__name__)
def test_a_write_whose_answer_was_lost_is_not_sent_again(
    kind: str, write: Callable[[Any], Any]
) -> None:
    # Given a server that applies the write and loses its answer
    def script(n: int) -> Reply:
        return LOST if n == 1 else repeat_answer(api.methods[-1])

    # When the client writes
    with Loopback(script) as api, pytest.raises(errors.ReachError) as caught:
        run(kind, api.base_url, write)

    # I expect the lost answer said as such, not a false conflict or not-found from a repeat
    assert type(caught.value) is errors.APIConnectionError, repr(caught.value)
    assert len(api.requests) == 1


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("refusal", [429, 503])
def test_a_write_refused_before_it_was_applied_is_sent_again(kind: str, refusal: int) -> None:
    code = "rate_limited" if refusal == 429 else "overloaded"
    replies = [problem_reply(refusal, code, **{"Retry-After": "0"}), SESSION_REPLY]
    with Loopback(lambda n: replies[n - 1]) as api:
        session = run(kind, api.base_url, update)
    assert session.revision == 2
    assert api.methods == ["PUT", "PUT"]


def test_a_connection_that_failed_before_the_request_went_out_says_so() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with (
        Reach(f"http://127.0.0.1:{port}", "rk_test", max_retries=0) as reach,
        pytest.raises(errors.APIConnectionError) as caught,
    ):
        reach.sessions.delete("s1")
    assert caught.value.sent is False
