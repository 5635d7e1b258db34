"""Answers the client cannot use end in one of its own errors, never a raw ``KeyError`` or
``JSONDecodeError``: a redirect (the API never answers one) is a ``RedirectError`` naming
where it pointed, a body that is not the API's JSON an ``UnexpectedAnswerError``, for calls
and for event streams alike; ``reach`` exits with its "API error" status for them. A stream
quieter than the client's timeout stays open (the server pings every 15 s). Both clients,
against a real loopback server (``client_loopback``)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

import pytest
from reach_client import AsyncReach, Reach, errors
from reach_client.cli import exits, main
from reach_client.models import Task
from reach_client.streaming import SSEDecoder

from tests.integration.receiver import Reply
from tests.unit.client_loopback import TASK, Loopback, events_reply, task_reply

MOVED = Reply(301, {"Location": "https://api.example/tasks/t1"}, b"")
PAGE = Reply(200, {"Content-Type": "text/html"}, b"<html>sign in</html>")
NOT_A_TASK = Reply(200, {"Content-Type": "application/json"}, b'["t1"]')
TASK_WITHOUT_ID = Reply(200, {"Content-Type": "application/json"}, b'{"status": "running"}')
BAD_EVENT = Reply(200, {"Content-Type": "text/event-stream"}, b"id: 1\ndata: {not json\n\n")
FINAL = {"seq": 1, "type": "succeeded", "data": {**TASK, "status": "succeeded"}}


def get(reach: Reach) -> object:
    return reach.tasks.get("t1")


async def get_async(reach: AsyncReach) -> object:
    return await reach.tasks.get("t1")


def stream(reach: Reach) -> object:
    return list(reach.tasks.stream("t1"))


async def stream_async(reach: AsyncReach) -> object:
    return [event async for event in reach.tasks.stream("t1")]


def against(
    reply: Reply | Callable[[int], Reply], action: Callable[[Any], Any], **options: Any
) -> Any:
    """``action`` on a client (blocking, or asyncio for a coroutine function) of a server
    that answers every request with ``reply`` (or what it gives for the request's number)."""
    with Loopback(reply if callable(reply) else lambda n: reply) as api:
        if not inspect.iscoroutinefunction(action):
            with Reach(api.base_url, "rk_test", **options) as reach:
                return action(reach)

        async def in_async() -> Any:
            async with AsyncReach(api.base_url, "rk_test", **options) as reach:
                return await action(reach)

        return asyncio.run(in_async())


CALLS = pytest.mark.parametrize(
    "action", [get, get_async, stream, stream_async], ids=["get", "aget", "stream", "astream"]
)


@CALLS
def test_a_redirect_is_an_error_that_names_where_it_pointed(action: Callable[[Any], Any]) -> None:
    with pytest.raises(errors.ReachError) as caught:
        against(MOVED, action)
    assert isinstance(caught.value, errors.RedirectError), repr(caught.value)
    assert caught.value.location == "https://api.example/tasks/t1"
    assert "https://api.example/tasks/t1" in str(caught.value) and "REACH_URL" in str(caught.value)


@CALLS
def test_a_page_instead_of_the_api_is_an_unexpected_answer(action: Callable[[Any], Any]) -> None:
    with pytest.raises(Exception) as caught:
        against(PAGE, action)
    assert isinstance(caught.value, errors.UnexpectedAnswerError), repr(caught.value)


@pytest.mark.parametrize("reply", [NOT_A_TASK, TASK_WITHOUT_ID], ids=["a list", "no task_id"])
@pytest.mark.parametrize("action", [get, get_async], ids=["sync", "async"])
def test_json_that_is_not_the_apis_shape_is_an_unexpected_answer(
    reply: Reply, action: Callable[[Any], Any]
) -> None:
    with pytest.raises(Exception) as caught:
        against(reply, action)
    assert isinstance(caught.value, errors.UnexpectedAnswerError), repr(caught.value)


@pytest.mark.parametrize("action", [stream, stream_async], ids=["sync", "async"])
def test_an_event_whose_data_is_not_json_is_an_unexpected_answer(
    action: Callable[[Any], Any],
) -> None:
    with pytest.raises(Exception) as caught:
        against(BAD_EVENT, action)
    assert isinstance(caught.value, errors.UnexpectedAnswerError), repr(caught.value)


@pytest.mark.parametrize(
    ("reply", "argv"),
    [
        (PAGE, ["tasks", "get", "t1"]),
        (MOVED, ["tasks", "get", "t1"]),
        (NOT_A_TASK, ["sessions", "list"]),
    ],
    ids=["a page", "a redirect", "a shape"],
)
def test_reach_exits_with_api_error_for_an_answer_it_cannot_use(
    reply: Reply,
    argv: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("REACH_CONFIG", "/nonexistent/reach.toml")
    monkeypatch.delenv("REACH_PROFILE", raising=False)
    with Loopback(lambda n: reply) as api:
        status = main([*argv, "--url", api.base_url, "--api-key", "rk_test"])
    assert status == exits.API_ERROR  # 1 would say the task failed
    assert "Traceback" not in capsys.readouterr().err


def test_reach_watch_exits_with_api_error_for_an_event_it_cannot_read(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("REACH_CONFIG", "/nonexistent/reach.toml")
    replies = [task_reply("running"), BAD_EVENT]
    with Loopback(lambda n: replies[n - 1]) as api:
        status = main(["tasks", "watch", "t1", "--url", api.base_url, "--api-key", "rk_test"])
    assert status == exits.API_ERROR
    assert "unexpected_answer" in capsys.readouterr().err


class Quiet:
    """A stream's answer that comes only after ``quiet_s`` of silence, as a task's stream is
    between its events (the server pings every 15 s of it)."""

    def __init__(self, quiet_s: float) -> None:
        self.quiet_s = quiet_s

    def __call__(self, n: int) -> Reply:
        time.sleep(self.quiet_s)
        return events_reply(FINAL)


@pytest.mark.parametrize("action", [stream, stream_async], ids=["sync", "async"])
def test_a_stream_quieter_than_the_clients_timeout_is_not_cut(
    action: Callable[[Any], Any],
) -> None:
    # Given a client whose timeout (0.3 s) is far below the server's ping interval
    found = against(Quiet(1.0), action, timeout=0.3, max_retries=0)
    # I expect the stream to wait for its event rather than give up on a live server
    assert [(e.id, e.type) for e in found] == [(1, "succeeded")]


def test_an_events_data_is_capped_in_bytes_not_characters() -> None:
    # Two lines of 30 two-byte characters: 62 characters, 122 bytes, past a 100-byte cap
    line = ("data: " + "\u00e9" * 30 + "\n").encode()
    decoder = SSEDecoder(cap=100)
    with pytest.raises(errors.APIConnectionError) as caught:
        decoder.decode(b"id: 1\n" + line + line + b"\n")
    assert caught.value.code == "answer_too_large"


def test_a_tasks_agent_with_a_field_the_client_does_not_know_is_read() -> None:
    agent = {"agent_id": "echo", "version": "1", "instance": "w1", "region": "eu"}
    task = Task.from_json({**TASK, "status": "running", "agent": agent})
    assert task.agent is not None and (task.agent.agent_id, task.agent.instance) == ("echo", "w1")
    assert task.raw["agent"]["region"] == "eu"


GATEWAY_PAGE = b"<html><body><h1>502 Bad Gateway</h1>\n<p>nginx</p></body></html>"


@pytest.mark.parametrize(
    ("status", "kind"),
    [(502, errors.InternalServerError), (404, errors.InvalidRequestError)],
)
def test_an_answer_that_is_no_problem_of_the_apis_says_what_it_was(
    status: int, kind: type[errors.APIStatusError], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A proxy's page read 'http_502 (HTTP 502): HTTP 502'; its 404 read as a task gone."""
    monkeypatch.setenv("REACH_CONFIG", "/nonexistent/reach.toml")
    page = Reply(status, {"Content-Type": "text/html"}, GATEWAY_PAGE)
    with (
        Loopback(lambda n: page) as api,
        Reach(api.base_url, "k", max_retries=0) as reach,
        pytest.raises(errors.APIStatusError) as caught,
    ):
        reach.tasks.get("t1")
    assert type(caught.value) is kind
    assert (caught.value.status, caught.value.code) == (status, f"http_{status}")
    assert caught.value.detail == (
        f"HTTP {status} with no problem of the API's (text/html):"
        " <html><body><h1>502 Bad Gateway</h1> <p>nginx</p></body></html>"
    )
