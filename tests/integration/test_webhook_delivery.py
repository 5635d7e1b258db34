"""Webhook delivery end to end: the API, a real Celery worker on reach.webhooks, and a real
HTTP receiver on 127.0.0.1 (allowed by the test settings). Signatures are checked with the
``standardwebhooks`` reference verifier. The test schedule is five attempts in about 1 s."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, text
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from broker.settings import Settings
from broker.webhooks import delivery_log
from tests.eventually import eventually
from tests.integration.receiver import Receiver, Reply, always
from tests.integration.stack import CeleryProcess, start_worker, wait_for_task
from tests.integration.webhook_client import finished, register, submit, wait_deliveries


def verify(secret: str, received: object) -> dict[str, object]:
    body, headers = received.body, received.headers  # type: ignore[attr-defined]
    payload: dict[str, object] = Webhook(secret).verify(body, headers)
    return payload


def test_given_a_webhook_when_a_task_succeeds_expect_a_signed_call_and_a_logged_delivery(
    client: httpx.Client,
) -> None:
    with Receiver() as receiver:
        webhook, secret = register(client, receiver.url, events=["task.succeeded"])
        task = submit(client, payload={"n": 1})
        [call] = receiver.wait_for(1)

        event = verify(secret, call)
        assert event["type"] == "task.succeeded"
        assert event["data"]["task_id"] == task["task_id"]  # type: ignore[index]
        assert event["data"]["result"] == {"n": 1}  # type: ignore[index]
        assert call.headers["x-trace-id"] == task["trace_id"]
        assert call.headers["traceparent"].split("-")[1] == task["trace_id"]
        assert call.headers["content-type"] == "application/json"

        path = f"/webhooks/{webhook['webhook_id']}/deliveries"
        [delivery] = wait_deliveries(client, path, finished("succeeded"))
    assert delivery["message_id"] == call.headers["webhook-id"]
    assert delivery["attempt_count"] == 1
    [attempt] = delivery["attempts"]
    assert attempt["status_code"] == 200 and attempt["error"] is None
    assert attempt["latency_ms"] >= 0 and attempt["at"] and attempt["address"] == "127.0.0.1"
    by_task = client.get(f"/tasks/{task['task_id']}/deliveries").json()["deliveries"]
    assert [d["delivery_id"] for d in by_task] == [delivery["delivery_id"]]
    # The secret was shown once, at creation; no read shows it again.
    assert secret not in client.get(f"/webhooks/{webhook['webhook_id']}").text
    assert secret not in client.get("/webhooks").text


def test_given_a_delivered_call_when_its_body_is_tampered_with_expect_verification_fails(
    client: httpx.Client,
) -> None:
    with Receiver() as receiver:
        _, secret = register(client, receiver.url)
        submit(client, payload={"amount": "10.00"})
        [call] = receiver.wait_for(1)
    verify(secret, call)
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(call.body.replace(b"10.00", b"99.00"), call.headers)


def test_given_a_receiver_down_for_three_attempts_expect_the_fourth_delivers_with_the_same_id(
    client: httpx.Client,
) -> None:
    down_then_up = Receiver(lambda n: Reply(drop=True) if n <= 3 else Reply(200))
    with down_then_up as receiver:
        webhook, secret = register(client, receiver.url)
        submit(client)
        calls = receiver.wait_for(4)
        path = f"/webhooks/{webhook['webhook_id']}/deliveries"
        [delivery] = wait_deliveries(client, path, finished("succeeded"))

    assert len({c.headers["webhook-id"] for c in calls}) == 1
    verify(secret, calls[3])
    assert delivery["attempt_count"] == 4
    assert [a["status_code"] for a in delivery["attempts"]] == [None, None, None, 200]
    assert all(a["error"] for a in delivery["attempts"][:3])


def test_given_a_receiver_that_always_fails_expect_the_message_dead_after_the_schedule(
    client: httpx.Client, settings: Settings
) -> None:
    replies = {"status": 500}
    with Receiver(lambda n: Reply(replies["status"])) as receiver:
        webhook, _ = register(client, receiver.url)
        submit(client)
        path = f"/webhooks/{webhook['webhook_id']}/deliveries"
        [dead] = wait_deliveries(client, path, finished("dead"))

        attempts = len(settings.webhook_schedule_s)
        assert dead["attempt_count"] == attempts
        assert [a["status_code"] for a in dead["attempts"]] == [500] * attempts
        assert len(receiver.requests) == attempts
        assert len({c.headers["webhook-id"] for c in receiver.requests}) == 1

        # When the receiver is fixed, a dead message can be sent again: same id, one attempt.
        replies["status"] = 200
        again = client.post(f"{path}/{dead['delivery_id']}/redeliver")
        assert again.status_code == 202, again.text
        [delivered] = wait_deliveries(client, path, finished("succeeded"))
    assert delivered["attempt_count"] == attempts + 1
    assert receiver.requests[-1].headers["webhook-id"] == dead["message_id"]


def test_a_delivery_is_sent_again_by_hand_a_bounded_number_of_times_and_lists_its_latest(
    client: httpx.Client, settings: Settings, engine: Engine
) -> None:
    """Each redelivery logs an attempt, and a page lists each delivery's attempts: a tenant
    looping over its failed deliveries piled attempts up without end, and every page read
    them all."""
    with Receiver(always(Reply(400, body=b"x" * 512))) as receiver:
        webhook, _ = register(client, receiver.url)
        submit(client)
        path = f"/webhooks/{webhook['webhook_id']}/deliveries"
        [failed] = wait_deliveries(client, path, finished("failed"))
        # When it is sent again, each time once it has failed, until it is refused
        allowed = len(settings.webhook_schedule_s) + delivery_log.REDELIVERIES_MAX
        answers = []
        for attempts in range(1, allowed + 1):
            again = client.post(f"{path}/{failed['delivery_id']}/redeliver")
            answers.append(again.status_code)
            if again.status_code != 202:
                break
            wait_deliveries(
                client, path, lambda found, n=attempts: found[0]["attempt_count"] == n + 1
            )
            wait_deliveries(client, path, finished("failed"))
    # Then it was sent again until it had been attempted that many times, and no more
    assert answers == [202] * (allowed - 1) + [409], answers
    assert again.json()["code"] == "delivery_not_redeliverable"
    assert len(receiver.requests) == allowed
    # And a page lists its latest attempts only, whatever its log holds
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO webhook_attempts (delivery_id, attempt, at, latency_ms) SELECT :id,"
                " n, now(), 1 FROM generate_series(CAST(:first AS int), CAST(:last AS int)) n"
            ),
            {"id": failed["delivery_id"], "first": allowed + 1, "last": allowed + 30},
        )
    [listed] = client.get(path).json()["deliveries"]
    shown = [a["attempt"] for a in listed["attempts"]]
    assert shown == list(range(allowed + 30 - delivery_log.ATTEMPTS_SHOWN + 1, allowed + 31))


def test_given_410_gone_expect_the_subscription_disabled_and_no_more_deliveries(
    client: httpx.Client,
) -> None:
    with Receiver(always(Reply(410))) as gone, Receiver() as control:
        webhook, _ = register(client, gone.url)
        watcher, _ = register(client, control.url)
        submit(client)
        path = f"/webhooks/{webhook['webhook_id']}/deliveries"
        [failed] = wait_deliveries(client, path, finished("failed"))
        assert failed["attempt_count"] == 1 and failed["last_status_code"] == 410

        shown = client.get(f"/webhooks/{webhook['webhook_id']}").json()
        assert shown["status"] == "disabled" and "410" in shown["disabled_reason"]

        # A later task reaches the control webhook (written in the same fanout) but not this.
        later = submit(client)
        control_path = f"/webhooks/{watcher['webhook_id']}/deliveries"
        wait_deliveries(client, control_path, lambda ds: ds[0]["task_id"] == later["task_id"])
        assert len(client.get(path).json()["deliveries"]) == 1
        again = client.post(f"{path}/{failed['delivery_id']}/redeliver")
    assert again.status_code == 409 and again.json()["code"] == "webhook_disabled"
    assert len(gone.requests) == 1


def test_given_a_redirect_to_a_canary_expect_it_not_followed(client: httpx.Client) -> None:
    with Receiver() as canary:
        redirect = Reply(302, {"Location": canary.url})
        with Receiver(always(redirect)) as receiver:
            webhook, _ = register(client, receiver.url)
            submit(client)
            path = f"/webhooks/{webhook['webhook_id']}/deliveries"
            [failed] = wait_deliveries(client, path, finished("failed"))
        # The attempt is over (recorded), and nothing ever reached the canary.
        assert canary.requests == []
    assert failed["attempts"][0]["status_code"] == 302 and failed["attempt_count"] == 1


def test_given_a_rotated_secret_expect_both_secrets_verify_during_the_grace_period(
    client: httpx.Client,
) -> None:
    with Receiver() as receiver:
        webhook, old = register(client, receiver.url)
        rotated = client.post(f"/webhooks/{webhook['webhook_id']}/rotate-secret")
        assert rotated.status_code == 200
        new = rotated.json()["secret"]
        assert new != old and rotated.json()["previous_secret_expires_at"]
        submit(client)
        [call] = receiver.wait_for(1)
    assert len(call.headers["webhook-signature"].split(" ")) == 2
    assert verify(old, call)["type"] == verify(new, call)["type"] == "task.succeeded"


def test_given_a_failing_task_expect_task_failed_only_where_subscribed(
    client: httpx.Client,
) -> None:
    with Receiver() as failures, Receiver() as invoices_only:
        on_failure, secret = register(client, failures.url, events=["task.failed"])
        filtered, _ = register(client, invoices_only.url, capabilities=["invoice.*"])
        task = submit(client, payload={"fail": "bad_input"})
        [call] = failures.wait_for(1)
        path = f"/webhooks/{filtered['webhook_id']}/deliveries"
        # Both subscriptions were judged in the one fanout that wrote the first delivery.
        assert client.get(path).json()["deliveries"] == []
    event = verify(secret, call)
    assert event["type"] == "task.failed"
    assert event["data"]["error"]["code"] == "bad_input"  # type: ignore[index]
    assert event["data"]["task_id"] == task["task_id"]  # type: ignore[index]
    assert on_failure["events"] == ["task.failed"]


def percent_of(request: Any) -> Any:
    return json.loads(request.body)["data"]["progress"]["percent"]


def test_given_a_progress_subscription_expect_the_latest_report_and_nothing_for_others(
    client: httpx.Client,
) -> None:
    """A task's reports made while its progress fanout waits on the queue ride on it (the
    fanout reads the latest progress when it runs): the invoice agent's three reports in a
    row come as one to three deliveries, the last report always among them."""
    invoice = {"text": "ACME\nInvoice No: INV-1\nDate: 2024-03-15\nTotal: USD 10.00"}
    with Receiver() as progress, Receiver() as finals:
        watcher, secret = register(client, progress.url, events=["task.progress"])
        final_only, _ = register(client, finals.url)  # the default: the four final events
        task = submit(client, "invoice.extract", payload=invoice)
        [final] = finals.wait_for(1)
        path = f"/webhooks/{final_only['webhook_id']}/deliveries"
        final_log = wait_deliveries(client, path, finished("succeeded"))
        reports = eventually(
            lambda: list(progress.requests),
            "the last report's delivery",
            until=lambda found: any(percent_of(r) == 100 for r in found),
        )

    events = [verify(secret, r) for r in reports]
    assert {e["type"] for e in events} == {"task.progress"}
    assert {e["data"]["task_id"] for e in events} == {task["task_id"]}  # type: ignore[index]
    assert len({r.headers["webhook-id"] for r in reports}) == len(reports)
    assert 1 <= len(reports) <= 3
    assert [d["event_type"] for d in final_log] == ["task.succeeded"]
    assert final.headers["webhook-id"] == final_log[0]["message_id"]
    assert watcher["events"] == ["task.progress"]


@pytest.fixture(scope="module")
def solo_worker(settings: Settings, log_dir: Path) -> Iterator[CeleryProcess]:
    """One pool process for ``test.solo``: a test's tasks all finish in the same process."""
    process = start_worker(settings, "test.solo", "solo", log_dir, concurrency=1)
    yield process
    process.stop()


def test_given_a_task_just_finished_when_a_subscription_is_made_expect_the_next_task_heard(
    client: httpx.Client, solo_worker: CeleryProcess
) -> None:
    # Given a task of this tenant that has just finished (no subscription yet) in the process
    # that will run the next one
    before = submit(client, "test.solo", payload={"n": 0})
    wait_for_task(client, before["task_id"], {"succeeded"})
    with Receiver() as receiver:
        # When a subscription is made (201) and a task is submitted at once
        _, secret = register(client, receiver.url, events=["task.succeeded"])
        after = submit(client, "test.solo", payload={"n": 1})
        # Expect that task's webhook, and only it
        [call] = receiver.wait_for(1, timeout_s=15)
    assert verify(secret, call)["data"]["task_id"] == after["task_id"]  # type: ignore[index]


def test_a_deliverys_log_lines_carry_its_tasks_trace_id(
    client: httpx.Client, tenant: tuple[str, str], system_workers: list[CeleryProcess]
) -> None:
    """The webhooks worker logged its attempts with no trace id, task id or tenant: a
    failing webhook's attempts could not be found by its task's trace."""
    [hooks] = [p for p in system_workers if "reach.webhooks" in p.args]
    trace = "0af7651916cd43dd8448eb211c8031aa"
    with Receiver() as receiver:
        register(client, receiver.url, events=["task.succeeded"])
        answer = client.post(
            "/tasks",
            json={"capability": "echo", "payload": {"traced": True}},
            headers={"X-Trace-Id": trace},
        )
        task_id = answer.json()["task_id"]
        [call] = receiver.wait_for(1)
    assert call.headers["x-trace-id"] == trace

    def attempts_logged() -> list[dict[str, Any]]:
        lines = [json.loads(line) for line in hooks.output().splitlines() if line.startswith("{")]
        return [line for line in lines if line.get("task_id") == task_id]

    [logged] = eventually(attempts_logged, "the attempt's log line")
    assert logged["message"].endswith("succeeded (200)"), logged
    assert (logged["trace_id"], logged["tenant"]) == (trace, tenant[0])
