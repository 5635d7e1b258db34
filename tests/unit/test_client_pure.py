"""The client's pure parts: error mapping, retry timing, SSE decoding, stream resumption, and
the plans driven by hand (no socket), so each rule is checked on its own."""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import httpx
import pytest
import standardwebhooks.webhooks as standard
from reach_client import Reach, errors
from reach_client.config import ConfigurationError, NoAPIKeyError, resolve
from reach_client.connection import Settings
from reach_client.limits import MAX_ANSWER_BYTES
from reach_client.models import Event, Task, Webhook
from reach_client.operations import tasks
from reach_client.plans import Plan, Request, Response, Sleep, send
from reach_client.retries import RetryPolicy, may_retry, parse_retry_after
from reach_client.streaming import Resume, SSEDecoder
from reach_client.webhooks import verify

POLICY = RetryPolicy(max_retries=2)
TASK = {"task_id": "t1", "capability": "echo", "status": "running", "trace_id": "tr"}


def answer(status: int, body: bytes = b"{}", **headers: str) -> Response:
    return Response(status, httpx.Headers(headers), body)


class Clock:
    """A monotonic clock that moves only as the plan sleeps, or as a test says a request
    took time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


Answer = Response | Exception | Callable[[Request], "Response | Exception"]


def drive(
    plan: Plan[object],
    answers: list[Answer],
    steps: list[object] | None = None,
    clock: Clock | None = None,
) -> tuple[object, list[object]]:
    """Run ``plan`` against scripted answers (each taken off ``answers`` as it is used; a
    callable is given the request); its result and every step it took, also in ``steps`` if
    given: there when the plan raises. Each sleep moves ``clock`` on."""
    steps = [] if steps is None else steps
    try:
        step = next(plan)
        while True:
            steps.append(step)
            if isinstance(step, Sleep):
                if clock is not None:
                    clock.now += step.seconds
                step = plan.send(None)
                continue
            given = answers.pop(0)
            if callable(given):
                given = given(step)
            step = plan.throw(given) if isinstance(given, Exception) else plan.send(given)
    except StopIteration as done:
        return done.value, steps


@pytest.mark.parametrize(
    ("status", "code", "kind"),
    [
        (401, "unauthenticated", errors.AuthenticationError),
        (403, "capability_not_allowed", errors.PermissionDeniedError),
        (404, "task_not_found", errors.NotFoundError),
        (409, "task_final", errors.ConflictError),
        (412, "revision_conflict", errors.RevisionConflictError),
        (428, "precondition_required", errors.PreconditionRequiredError),
        (429, "rate_limited", errors.RateLimitError),
        (503, "overloaded", errors.UnavailableError),
        (422, "payload_invalid", errors.InvalidRequestError),
        (413, "payload_too_large", errors.InvalidRequestError),
        (500, "internal", errors.InternalServerError),
    ],
)
def test_a_problem_maps_to_its_error_class(status: int, code: str, kind: type) -> None:
    problem = {"code": code, "detail": "d", "trace_id": "abc", "current_revision": 7}
    found = errors.from_problem(status, problem)
    assert type(found) is kind
    assert (found.code, found.status, found.detail, found.trace_id) == (code, status, "d", "abc")


def test_a_revision_conflict_names_the_current_revision() -> None:
    found = errors.from_problem(412, {"code": "revision_conflict", "current_revision": 4})
    assert isinstance(found, errors.RevisionConflictError) and found.current_revision == 4


def test_a_body_that_is_not_a_problem_still_maps_by_status() -> None:
    found = errors.from_problem(502, "<html>bad gateway</html>", trace_id="from-header")
    assert isinstance(found, errors.InternalServerError)
    assert (found.code, found.trace_id) == ("http_502", "from-header")


def test_backoff_doubles_is_capped_and_jittered_down_by_at_most_a_quarter() -> None:
    policy = RetryPolicy(initial_delay_s=0.5, max_delay_s=8)
    rng = random.Random(7)
    for retry, base in ((1, 0.5), (2, 1.0), (3, 2.0), (6, 8.0), (10, 8.0)):
        delay = policy.backoff_s(retry, rng)
        assert base * 0.75 <= delay <= base


def test_retry_after_is_seconds_or_an_http_date_and_too_long_is_not_waited() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(format_datetime(now + timedelta(seconds=30)), now) == 30.0
    assert parse_retry_after("soon") is None
    assert POLICY.delay_s(1, "2") == 2.0
    assert POLICY.delay_s(1, "3600") is None
    assert 0.375 <= (POLICY.delay_s(1, None) or 0) <= 0.5


def test_only_requests_safe_to_repeat_are_retried_whatever_became_of_the_last_try() -> None:
    assert may_retry("GET", False) and may_retry("POST", True) and may_retry("PATCH", True)
    # A compare-and-set on If-Match, a DELETE that answers 404 once it took, a POST
    assert not may_retry("PUT", False) and not may_retry("DELETE", False)
    assert not may_retry("POST", False) and not may_retry("PATCH", False)


def test_a_503_is_retried_after_retry_after_with_the_very_same_request() -> None:
    request = Request("POST", "/tasks", body={}, headers={"Idempotency-Key": "k1"})
    refused = answer(503, b'{"code": "overloaded"}', **{"Retry-After": "1"})
    result, steps = drive(send(request, POLICY), [refused, answer(202, b'{"ok": 1}')])
    assert steps == [request, Sleep(1.0), request]
    assert isinstance(result, Response) and result.status == 202


@pytest.mark.parametrize(
    "request_", [Request("POST", "/sessions", body={}), Request("PUT", "/sessions/s1", body={})]
)
def test_a_write_without_a_key_is_retried_only_when_it_was_surely_not_applied(
    request_: Request,
) -> None:
    lost = errors.APIConnectionError("reset by peer")  # it may have been applied
    with pytest.raises(errors.APIConnectionError):
        drive(send(request_, POLICY), [lost])
    with pytest.raises(errors.InternalServerError):
        drive(send(request_, POLICY), [answer(502, b"bad gateway")])
    # Never sent (a refused connection), or refused unapplied (429, 503): sent again
    refused = errors.APIConnectionError("refused", sent=False)
    overloaded = answer(503, b'{"code": "overloaded"}', **{"Retry-After": "0"})
    for first in (refused, overloaded):
        result, steps = drive(send(request_, POLICY), [first, answer(200)])
        assert [s for s in steps if isinstance(s, Request)] == [request_, request_]
        assert isinstance(result, Response) and result.status == 200


def test_connection_errors_are_retried_until_the_budget_is_spent() -> None:
    request = Request("GET", "/tasks/t1")
    lost = [errors.APIConnectionError("reset") for _ in range(3)]
    # A budget of two retries: three tries, each lost, and the last error raised
    left: list[Response | Exception] = list(lost)
    steps: list[object] = []
    with pytest.raises(errors.APIConnectionError) as caught:
        drive(send(request, POLICY), left, steps)
    assert caught.value is lost[2]
    assert left == []
    assert [type(s) for s in steps] == [Request, Sleep, Request, Sleep, Request]
    assert steps[::2] == [request] * 3
    # One lost, then an answer: that answer, after one retry
    result, steps = drive(send(request, POLICY), [lost[0], answer(200)])
    assert [type(s) for s in steps] == [Request, Sleep, Request]
    assert isinstance(result, Response) and result.status == 200


def test_wait_polls_until_final_and_gives_up_with_the_task_when_time_runs_out() -> None:
    clock = Clock()
    running = answer(200, b'{"task_id": "t1", "capability": "echo", "status": "running"}')
    steps: list[object] = []
    with pytest.raises(errors.WaitTimeoutError) as caught:
        drive(tasks.wait(POLICY, "t1", 1.0, clock), [running] * 20, steps, clock)
    assert caught.value.task is not None and caught.value.task.status == "running"
    # Every poll and every pause ended by the deadline
    assert clock.now == pytest.approx(1.0)
    assert all(0 < (s.within_s or 0) <= 1.0 for s in steps if isinstance(s, Request))
    done = answer(200, b'{"task_id": "t1", "capability": "echo", "status": "succeeded"}')
    result, steps = drive(tasks.wait(POLICY, "t1", None), [running, done])
    assert isinstance(result, Task) and result.status == "succeeded"
    assert [type(s) for s in steps] == [Request, Sleep, Request]


def test_a_sync_submit_the_caller_would_not_wait_out_is_asked_again_in_async_mode() -> None:
    clock = Clock()

    def timed_out(request: Request) -> Exception:
        clock.now += request.timeout_s or 0  # the read timeout the client gave it
        return errors.APITimeoutError()

    queued = answer(202, b'{"task_id": "t1", "capability": "echo", "status": "queued"}')
    plan = tasks.run(POLICY, {"capability": "echo", "payload": {}}, "k1", 5.0, clock)
    steps: list[object] = []
    with pytest.raises(errors.WaitTimeoutError) as caught:
        drive(plan, [timed_out, queued, *[queued] * 20], steps, clock)
    assert caught.value.task is not None and caught.value.task.task_id == "t1"
    # The sync submit timed out, leaving a second of the wait to learn its task: the same
    # submit, same key, asked again in async mode; then the task is polled until the
    # caller's time is up
    sync, again, *polls = steps
    assert isinstance(sync, Request) and isinstance(again, Request)
    assert (sync.method, sync.path, sync.body["reply_mode"]) == ("POST", "/tasks", "sync")
    assert (sync.timeout_s, sync.within_s) == (4.0, 5.0)
    assert (again.method, again.path) == ("POST", "/tasks")
    assert again.body == {"capability": "echo", "payload": {}, "reply_mode": "async"}
    assert sync.idempotency_key == again.idempotency_key == "k1"
    assert {(p.method, p.path) for p in polls if isinstance(p, Request)} == {("GET", "/tasks/t1")}
    assert clock.now == pytest.approx(5.0)


def test_the_sse_decoder_reads_frames_and_skips_pings() -> None:
    decoder = SSEDecoder()
    lines = [
        ": ping",
        "",
        "id: 4",
        "event: output",
        'data: {"seq": 4, "type": "output", "data": {"x": 1}, "trace_id": "t", "at": 1.5}',
        "",
    ]
    found = [e for e in map(decoder.feed, lines) if e is not None]
    assert found == [Event(id=4, type="output", data={"x": 1}, trace_id="t", at=1.5)]


def test_the_sse_decoder_reads_bytes_split_anywhere_with_any_line_break() -> None:
    frame = 'id: 4\r\ndata: {"seq": 4, "type": "output", "data": "caf\u00e9"}\r\n\r\n'
    stream = (": ping\r" + frame + frame.replace("\r\n", "\n").replace("4", "5")).encode()
    for size in (1, 2, 3, 7, len(stream)):  # a CRLF, a line and a UTF-8 character split
        decoder = SSEDecoder()
        pieces = [stream[i : i + size] for i in range(0, len(stream), size)]
        found = [e for piece in pieces for e in decoder.decode(piece)]
        assert [(e.id, e.data) for e in found] == [(4, "caf\u00e9"), (5, "caf\u00e9")], size


def test_an_event_past_the_cap_is_given_up() -> None:
    decoder = SSEDecoder()
    line = "data: " + "a" * (1024 * 1024)
    with pytest.raises(errors.APIConnectionError) as raised:
        for _ in range(MAX_ANSWER_BYTES // len(line) + 2):
            decoder.feed(line)
    assert raised.value.code == "answer_too_large"


def test_the_api_key_is_in_no_repr() -> None:
    key = "rk_secret_key_1234"
    settings = Settings.of("http://x", key, None, None, 0)
    config = resolve("http://x", key, env={"REACH_CONFIG": "/nonexistent/reach.toml"})
    assert key not in repr(settings) and key not in repr(config)
    hook = Webhook.from_json({"webhook_id": "w", "url": "u", "events": [], "secret": "whsec_x"})
    assert "whsec_x" not in repr(hook)


def event(seq: int, kind: str = "output") -> Event:
    return Event(id=seq, type=kind, data={})


def test_resume_asks_after_the_last_event_and_never_delivers_one_twice() -> None:
    resume = Resume("t1", POLICY)
    assert "Last-Event-ID" not in resume.request().headers
    assert [resume.accept(event(n)) for n in (1, 2)] == [True, True]
    assert resume.request().headers["Last-Event-ID"] == "2"
    assert resume.accept(event(2)) is False
    assert resume.accept(event(3, "succeeded")) and resume.done


class Seconds:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_resume_gives_up_after_reconnects_that_bring_nothing_for_its_window() -> None:
    clock = Seconds()
    resume = Resume("t1", POLICY, clock=clock)
    resume.dropped(None)
    resume.dropped(errors.APIConnectionError("reset"))
    resume.dropped(None)  # past max_retries, but the API may be restarting: a moment ago
    clock.now += POLICY.stream_reconnect_s - 1
    resume.dropped(errors.APIConnectionError("refused"))
    clock.now += 1
    with pytest.raises(errors.APIConnectionError):
        resume.dropped(None)
    with pytest.raises(errors.NotFoundError):
        Resume("t1", POLICY).dropped(errors.from_problem(404, {"code": "task_not_found"}))


def test_an_event_starts_the_streams_reconnect_window_again() -> None:
    clock = Seconds()
    resume = Resume("t1", POLICY, clock=clock)
    for _ in range(POLICY.max_retries + 1):
        resume.dropped(None)
    clock.now += POLICY.stream_reconnect_s - 1
    assert resume.accept(event(1))
    clock.now += 2  # the window counts from the first failure after the event
    for _ in range(POLICY.max_retries + 1):
        resume.dropped(None)
    clock.now += POLICY.stream_reconnect_s
    with pytest.raises(errors.APIConnectionError):
        resume.dropped(None)


def test_resume_waits_as_the_server_asks_and_raises_when_asked_to_wait_too_long() -> None:
    def unavailable(seconds: float) -> errors.ReachError:
        return errors.from_problem(503, {"code": "overloaded"}, retry_after_s=seconds)

    assert Resume("t1", POLICY).dropped(unavailable(7)) == 7
    with pytest.raises(errors.UnavailableError) as caught:
        Resume("t1", POLICY).dropped(unavailable(POLICY.max_retry_after_s + 1))
    assert caught.value.retry_after_s == POLICY.max_retry_after_s + 1


def test_verify_returns_the_event_and_refuses_anything_else() -> None:
    secret = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    body = (
        b'{"type": "task.succeeded", "timestamp": "x", "data": '
        + str(TASK).replace("'", '"').encode()
        + b"}"
    )
    now = datetime.now(UTC)
    signature = standard.Webhook(secret).sign("msg_1", now, body.decode())
    headers = {
        "webhook-id": "msg_1",
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": signature,
    }
    found = verify(secret, body, headers)
    assert found.type == "task.succeeded" and found.task and found.task.task_id == "t1"
    with pytest.raises(errors.WebhookVerificationError):
        verify(secret, body + b" ", headers)
    with pytest.raises(errors.WebhookVerificationError):
        verify(secret, body, {**headers, "webhook-signature": "garbage"})


UNREADABLE_RETRY_AFTER = ["\u00b2", "Fri, 31 Dec 9999999999999999999 23:59:59 GMT", "nan", "inf"]


@pytest.mark.parametrize("retry_after", UNREADABLE_RETRY_AFTER)
def test_a_retry_after_the_client_cannot_read_is_none_and_the_error_is_raised_as_such(
    retry_after: str,
) -> None:
    """``²`` passed ``str.isdigit`` and ``float`` refused it: a ValueError, not the API's
    error, from any call a hostile server answered so (and the CLI's exit 1); a year past
    ``datetime`` raised OverflowError (an audit, 2026-12-06)."""
    assert parse_retry_after(retry_after) is None
    headers = httpx.Headers({"Retry-After": retry_after.encode()})  # as a server sends it
    refused = Response(429, headers, b'{"code": "rate_limited"}')
    with pytest.raises(errors.APIStatusError) as caught:
        drive(send(Request("GET", "/tasks/t1"), POLICY), [refused] * 3)
    assert caught.value.retry_after_s is None


@pytest.mark.parametrize(
    "url", ["http://localhost:80a0", "http://[::1", "localhost:8000", "ftp://host", "http://"]
)
def test_a_url_that_names_no_http_host_is_a_configuration_error_before_any_request(
    url: str,
) -> None:
    with pytest.raises(ConfigurationError) as raised:
        Reach(url, "rk_x")
    assert repr(url) in str(raised.value)


NO_FILE = {"REACH_CONFIG": "/nonexistent/reach.toml"}


def test_a_key_with_a_line_end_around_it_is_the_key_and_one_with_others_is_refused_unquoted() -> (
    None
):
    """``$(cat key.txt)`` of a file with CRLF leaves a CR: httpx refused the header, and its
    error, printed on stderr, held the whole key. Non-ASCII was a traceback."""
    key = "rk_0123abcd4567_" + "A" * 43
    assert resolve("http://x", f"  {key}\r\n", env=NO_FILE).api_key == key
    for broken in (f"rk_a b{key}", f"{key}\x00", f"{key}ü", "\r\n"):
        with pytest.raises(ConfigurationError) as refused:
            resolve("http://x", broken, env=NO_FILE)
        assert key not in str(refused.value) and "rk_" not in str(refused.value)


def test_a_key_given_empty_is_none_given_not_the_environments() -> None:
    """``--api-key ''`` took REACH_API_KEY instead, without a word."""
    with pytest.raises(NoAPIKeyError):
        resolve("http://x", "", env={**NO_FILE, "REACH_API_KEY": "rk_other_key"})
    assert resolve("http://x", None, env={**NO_FILE, "REACH_API_KEY": "rk_other"}).api_key == (
        "rk_other"
    )


def test_an_empty_id_is_refused_before_any_request() -> None:
    """``/tasks/`` is the list's route, redirected: ``get("")`` was told to fix its URL."""
    with Reach("http://127.0.0.1:9", "rk_k") as reach, pytest.raises(ValueError, match="empty"):
        reach.tasks.get("")


def test_a_stream_reconnect_window_of_zero_gives_up_when_the_retries_run_out() -> None:
    with Reach("http://127.0.0.1:9", "k", max_retries=1, stream_reconnect_s=0) as reach:
        policy = reach._settings.policy
    resume = Resume("t1", policy, clock=Seconds())
    resume.dropped(None)
    with pytest.raises(errors.APIConnectionError):
        resume.dropped(None)


@pytest.mark.parametrize("seconds", [-1.0, float("nan")])
def test_a_stream_reconnect_window_that_is_no_number_of_seconds_is_refused(seconds: float) -> None:
    with pytest.raises(ValueError, match="stream_reconnect_s"):
        Reach("http://127.0.0.1:9", "k", stream_reconnect_s=seconds)
