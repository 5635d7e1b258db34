"""What a tenant's event logs count against ``REACH_TENANT_MAX_EVENT_BYTES`` is what they take
in Redis: their events, and with each new log its stream's first node and its keys
(``LOG_OVERHEAD_BYTES``). Counted by their events alone, 2,000 small ``echo`` tasks took 5.85
times what their tenant was counted.
"""

from __future__ import annotations

import time
import uuid

import httpx
import redis

from broker.settings import Settings
from broker.tasks import events
from broker.tasks.events import (
    EventLog,
    attempt_key,
    bytes_key,
    final_key,
    gone_by_hour,
    handed_key,
    log_key,
    seq_key,
    tenant_bytes_key,
)
from tests.eventually import eventually
from tests.integration.stack import wait_for_task
from tests.integration.test_tenant_quota import in_redis

TASKS = 20
WITHIN = 1.5  # the count may be this far either side of what the logs take


def taken(client: redis.Redis, task_id: str) -> int:
    """What a task's log takes in Redis, by MEMORY USAGE over every key it has."""
    keys = (log_key, seq_key, final_key, attempt_key, bytes_key, handed_key)
    return sum(client.memory_usage(key(task_id), samples=0) or 0 for key in keys)


def test_a_tenants_counted_event_bytes_are_within_half_again_what_its_logs_take_in_redis(
    settings: Settings, client: httpx.Client, tenant: tuple[str, str]
) -> None:
    task_ids = []
    for _ in range(TASKS):
        answer = client.post("/tasks", json={"capability": "echo", "payload": {}})
        assert answer.status_code == 202, answer.text
        task_ids.append(answer.json()["task_id"])
    for task_id in task_ids:
        assert wait_for_task(client, task_id, {"succeeded", "failed"})["status"] == "succeeded"
    store = redis.Redis.from_url(settings.redis_url)
    eventually(
        lambda: all(store.exists(final_key(t)) for t in task_ids), "every log has its final event"
    )
    counted = in_redis(settings.redis_url, tenant[0])
    in_memory = sum(taken(store, t) for t in task_ids)
    assert in_memory / WITHIN <= counted <= in_memory * WITHIN, (counted, in_memory)


def test_a_log_counts_its_stream_and_keys_once_in_the_hour_its_first_event_goes(
    own_redis: str,
) -> None:
    client = redis.Redis.from_url(own_redis)
    log = EventLog(client, 60, max_bytes=1 << 20)
    task = uuid.uuid4()
    first = gone_by_hour(60, time.time())
    log.append(task, "status", {"status": "running"}, tenant="a", trace_id="t", attempt=1)
    log.append(task, "output", "x" * 100, tenant="a", trace_id="t", attempt=1)
    last = gone_by_hour(60, time.time())
    stored = sum(len(fields[b"e"]) for _, fields in client.xrange(log_key(task)))
    counted = client.hgetall(tenant_bytes_key("a"))
    assert sum(int(n) for n in counted.values()) == stored + events.LOG_OVERHEAD_BYTES
    # in the hour the log's events go by (two across an hour's end): the API stops counting
    # it with them, and deletes its field as it reads
    assert {int(hour) for hour in counted} <= set(range(first, last + 1))
    # a log lost (expired) and begun again is counted anew: the old count lapses with its hour
    client.delete(log_key(task))
    log.append(task, "output", "y", tenant="a", trace_id="t", attempt=1)
    again = sum(len(fields[b"e"]) for _, fields in client.xrange(log_key(task)))
    total = sum(int(n) for n in client.hvals(tenant_bytes_key("a")))
    assert total == stored + again + 2 * events.LOG_OVERHEAD_BYTES
