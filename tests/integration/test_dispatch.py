"""The API's direct publish: the message it LPUSHes is the one Celery's ``send_task`` would
have published, and a real worker runs it (the rest of the suite submits through it too)."""

from __future__ import annotations

import base64
import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import redis

from broker.settings import Settings
from broker.tasks.dispatch import RUN_TASK, Dispatcher, redis_lists, redis_run_message, send_run


def _decoded(raw: bytes) -> dict[str, Any]:
    message = json.loads(raw)
    message["body"] = json.loads(base64.b64decode(message["body"]))
    # Unique per publish, or per thread (Celery's reply_to is its thread's oid; results are
    # ignored, so nothing ever replies to it).
    message["properties"].pop("delivery_tag")
    message["properties"].pop("reply_to")
    message["properties"].pop("expiration", None)
    # A new parent span id per message: its trace is what both carry alike.
    headers = message["headers"]
    traceparent = headers.pop("traceparent")
    assert traceparent.startswith("00-") and traceparent.endswith("-01"), traceparent
    headers["traceparent's trace"] = traceparent[len("00-") : -len("-0123456789abcdef-01")]
    return message


def test_direct_message_is_what_send_task_publishes(own_redis: str, settings: Settings) -> None:
    dispatcher = Dispatcher(settings.model_copy(update={"redis_url": own_redis}))
    client = redis.Redis.from_url(own_redis)
    try:
        assert dispatcher.direct
        for deadline_at in (None, datetime.now(UTC) + timedelta(seconds=30)):
            for behind in (False, True):
                task_id = uuid.uuid4()
                send_run(
                    dispatcher.app,
                    task_id,
                    "parity.q",
                    trace_id="t-1",
                    tenant="acme",
                    deadline_at=deadline_at,
                    behind=behind,
                )
                # kombu put it in the list of its priority: the queue's own, or the last one
                published = {key: client.rpop(key) for key in redis_lists("parity.q")}
                [(key, raw)] = [(k, v) for k, v in published.items() if v is not None]
                assert key == ("parity.q\x06\x169" if behind else "parity.q")
                built_key, built = redis_run_message(
                    dispatcher.app,
                    task_id,
                    "parity.q",
                    trace_id="t-1",
                    tenant="acme",
                    deadline_at=deadline_at,
                    behind=behind,
                )
                assert built_key == key
                assert _decoded(built) == _decoded(raw)
                assert _decoded(built)["headers"]["task"] == RUN_TASK
                assert ("expiration" in json.loads(built)["properties"]) == (
                    deadline_at is not None
                )
    finally:
        dispatcher.close()
        client.close()


def test_direct_only_when_the_broker_is_the_events_redis(settings: Settings) -> None:
    amqp = settings.model_copy(update={"broker_url": "amqp://guest@127.0.0.1:5672//"})
    other_db = settings.model_copy(update={"broker_url": settings.redis_url + "0"})
    assert Dispatcher(settings).direct
    assert not Dispatcher(amqp).direct
    assert not Dispatcher(other_db).direct
