"""Sync and stream reply modes, and the SSE event stream of a task."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Iterator

import httpx
import pytest
from sqlalchemy import Engine

from api.app import create_app
from broker.settings import Settings
from tests.eventually import eventually
from tests.integration.conftest import client_for
from tests.integration.stack import CeleryProcess, ServedApp, wait_for_task
from tests.integration.test_final_events import final_events, finished_without_final_event

FINAL = {"succeeded", "failed", "cancelled", "expired"}
TEXT = (
    "Agents advertise capabilities to the broker. The broker routes tasks to queues. "
    "Workers consume queues and run agents. Results land in Postgres with a TTL. "
    "Streams show progress and partial output. Callers resume streams after a drop."
)


def frames(lines: Iterator[str]) -> Iterator[dict[str, object]]:
    """Parse SSE frames from a line iterator (comments included, as {'comment': text})."""
    frame: dict[str, object] = {}
    for line in lines:
        if line == "":
            if frame:
                yield frame
                frame = {}
        elif line.startswith(":"):
            yield {"comment": line[1:].strip()}
        else:
            field, _, value = line.partition(": ")
            frame[field] = json.loads(value) if field == "data" else value
    if frame:
        yield frame


def read_stream(
    http: httpx.Client, method: str, url: str, **kwargs: object
) -> list[dict[str, object]]:
    with http.stream(method, url, **kwargs) as response:  # type: ignore[arg-type]
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        assert response.headers["x-accel-buffering"] == "no"
        return [f for f in frames(response.iter_lines()) if "comment" not in f]


@pytest.fixture
def tuned(settings: Settings, worker: CeleryProcess) -> Iterator[ServedApp]:
    """An API with a short sync wait, fast pings and a short send timeout."""
    tuned_settings = settings.model_copy(
        update={"sync_max_wait_s": 0.5, "sse_ping_s": 0.3, "sse_send_timeout_s": 1.0}
    )
    with ServedApp(create_app(tuned_settings)) as served:
        yield served


def test_sync_returns_the_finished_task(client: httpx.Client) -> None:
    response = client.post(
        "/tasks",
        json={
            "capability": "invoice.extract",
            "reply_mode": "sync",
            "payload": {"text": "Invoice No: S-1\nTotal: USD 5.00"},
        },
    )
    assert response.status_code == 200
    task = response.json()
    assert task["status"] == "succeeded"
    assert task["result"]["number"] == "S-1"
    assert response.headers["location"] == f"/tasks/{task['task_id']}"


def test_sync_past_its_wait_answers_202_and_the_task_still_finishes(
    tuned: ServedApp, tenant: tuple[str, str]
) -> None:
    with client_for(tuned, tenant[1]) as http:
        response = http.post(
            "/tasks",
            json={
                "capability": "text.summarize",
                "reply_mode": "sync",
                "payload": {"text": TEXT, "delay_s": 0.5},
            },
        )
        assert response.status_code == 202
        assert response.json()["status"] in ("queued", "running")
        done = wait_for_task(http, response.json()["task_id"], FINAL)
    assert done["status"] == "succeeded"


def test_a_stream_carries_status_progress_outputs_and_the_final_event_in_order(
    client: httpx.Client,
) -> None:
    events = read_stream(
        client,
        "POST",
        "/tasks",
        json={
            "capability": "text.summarize",
            "reply_mode": "stream",
            "payload": {"text": TEXT, "max_sentences": 3},
        },
    )
    ids = [int(str(e["id"])) for e in events]
    assert ids == list(range(1, len(events) + 1))
    kinds = [e["event"] for e in events]
    assert kinds[:2] == ["status", "status"]
    assert [e["data"]["data"]["status"] for e in events[:2]] == ["queued", "running"]
    assert kinds[-1] == "succeeded"
    assert kinds[2:-1] == ["output", "progress"] * 3
    outputs = [e["data"]["data"]["sentence"] for e in events if e["event"] == "output"]
    final = events[-1]["data"]["data"]
    assert outputs == final["result"]["sentences"]
    assert final["status"] == "succeeded"
    trace_ids = {e["data"]["trace_id"] for e in events}
    assert trace_ids == {final["trace_id"]}


def test_reconnecting_with_last_event_id_gets_exactly_the_rest(client: httpx.Client) -> None:
    task_id = client.post(
        "/tasks",
        json={
            "capability": "text.summarize",
            "payload": {"text": TEXT, "max_sentences": 5, "delay_s": 0.3},
        },
    ).json()["task_id"]
    first: list[dict[str, object]] = []
    with client.stream("GET", f"/tasks/{task_id}/events") as response:
        for frame in frames(response.iter_lines()):
            if "comment" not in frame:
                first.append(frame)
            if len(first) == 4:
                break  # the client drops mid-stream
    rest = read_stream(
        client, "GET", f"/tasks/{task_id}/events", headers={"Last-Event-ID": str(first[-1]["id"])}
    )
    everything = read_stream(client, "GET", f"/tasks/{task_id}/events")  # replay, finished
    assert [f["id"] for f in first + rest] == [f["id"] for f in everything]
    assert [f["data"] for f in first + rest] == [f["data"] for f in everything]
    assert everything[-1]["event"] == "succeeded"


def test_a_stream_opened_after_completion_replays_everything_and_ends(client: httpx.Client) -> None:
    task_id = client.post("/tasks", json={"capability": "test.gen", "payload": {"n": 4}}).json()[
        "task_id"
    ]
    done = wait_for_task(client, task_id, FINAL)
    events = read_stream(client, "GET", f"/tasks/{task_id}/events")
    assert [e["event"] for e in events] == ["status", "status", *["output"] * 4, "succeeded"]
    assert [e["data"]["data"] for e in events if e["event"] == "output"] == [
        {"i": i} for i in range(4)
    ]
    assert done["result"] == {"outputs": [{"i": i} for i in range(4)]}


def test_pings_keep_a_quiet_stream_alive(tuned: ServedApp, tenant: tuple[str, str]) -> None:
    with client_for(tuned, tenant[1]) as http:
        task_id = http.post(
            "/tasks",
            json={
                "capability": "text.summarize",
                "payload": {"text": TEXT, "max_sentences": 2, "delay_s": 1.5},
            },
        ).json()["task_id"]
        with http.stream("GET", f"/tasks/{task_id}/events") as response:
            seen = list(frames(response.iter_lines()))
    assert {"comment": "ping"} in seen
    assert [f for f in seen if "comment" not in f][-1]["event"] == "succeeded"


def test_a_client_that_disconnects_does_not_affect_the_task(client: httpx.Client) -> None:
    with client.stream(
        "POST",
        "/tasks",
        json={
            "capability": "text.summarize",
            "reply_mode": "stream",
            "payload": {"text": TEXT, "delay_s": 0.3},
        },
    ) as response:
        task_id = response.headers["location"].rsplit("/", 1)[1]
    assert wait_for_task(client, task_id, FINAL)["status"] == "succeeded"


def test_a_client_that_stops_reading_is_dropped(
    tuned: ServedApp, tenant: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    with client_for(tuned, tenant[1]) as http:
        task_id = http.post(
            "/tasks", json={"capability": "test.flood", "payload": {"n": 120, "size": 32_000}}
        ).json()["task_id"]
        wait_for_task(http, task_id, FINAL)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    with caplog.at_level(logging.INFO, logger="reach.sse"):
        sock.connect(("127.0.0.1", tuned.port))
        sock.sendall(
            f"GET /tasks/{task_id}/events HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {tenant[1]}\r\n\r\n".encode()
        )
        # Not reading: the socket buffers fill, and past the 1 s send timeout the API gives up
        eventually(
            lambda: "dropped an SSE client that stopped reading" in caplog.messages,
            "the API to drop the client",
        )
    received = bytearray()
    sock.settimeout(10)
    while chunk := sock.recv(65536):
        received += chunk
    sock.close()
    assert b"event: output" in received
    assert b"event: succeeded" not in received  # the server gave up on this client


def test_a_bad_last_event_id_is_400_and_a_foreign_task_404(
    client: httpx.Client, api: ServedApp, make_key
) -> None:  # type: ignore[no-untyped-def]
    task_id = client.post("/tasks", json={"capability": "echo", "payload": {}}).json()["task_id"]
    bad = client.get(f"/tasks/{task_id}/events", headers={"Last-Event-ID": "abc"})
    assert bad.status_code == 400
    assert bad.json()["code"] == "invalid_last_event_id"
    _, stranger = make_key()
    with client_for(api, stranger) as http:
        assert http.get(f"/tasks/{task_id}/events").status_code == 404


def test_200_concurrent_streams_on_one_api_all_complete(
    api: ServedApp, tenant: tuple[str, str], worker: CeleryProcess
) -> None:
    async def one(http: httpx.AsyncClient, i: int) -> str:
        last = ""
        async with http.stream(
            "POST",
            "/tasks",
            json={"capability": "echo", "reply_mode": "stream", "payload": {"i": i}},
        ) as response:
            if response.status_code != 200:
                return f"{response.status_code}: {(await response.aread())[:300]!r}"
            lines = []
            async for line in response.aiter_lines():
                lines.append(line)
                if line.startswith("event: "):
                    last = line.removeprefix("event: ")
        return last or repr(lines)[:500]

    async def all_streams() -> list[str]:
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
        async with httpx.AsyncClient(
            base_url=api.url,
            limits=limits,
            timeout=120,
            headers={"Authorization": f"Bearer {tenant[1]}"},
        ) as http:
            return await asyncio.gather(*(one(http, i) for i in range(200)))

    assert asyncio.run(all_streams()) == ["succeeded"] * 200


def test_a_quiet_stream_of_a_task_final_in_postgres_appends_its_final_event_and_ends(
    tuned: ServedApp, tenant: tuple[str, str], engine: Engine, redis_url: str
) -> None:
    # Given a task whose worker died between its final write and its final event, an hour ago
    # (beyond the reaper's window), and no message to redeliver
    row = finished_without_final_event(engine, redis_url, tenant[0], finished_ago_s=3600)
    # When a client streams its events
    with client_for(tuned, tenant[1]) as http:
        events = read_stream(http, "GET", f"/tasks/{row['id']}/events")
    # Then, after a quiet spell, the stream ends with the final event the log now holds
    assert [(e["id"], e["event"]) for e in events] == [
        ("1", "status"),
        ("2", "status"),
        ("3", "succeeded"),
    ]
    [logged] = final_events(redis_url, row["id"])
    assert (logged.seq, logged.type) == (3, "succeeded")
    assert logged.data == events[-1]["data"]["data"]
