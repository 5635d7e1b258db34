"""The example async agent ``llm.complete`` against a real loopback model
(``reach.fakemodel``): its tokens stream as output events, in order; a model it cannot reach
is retried, then fails with a retryable code."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from broker.settings import Settings
from tests.eventually import eventually
from tests.integration.stack import CeleryProcess, free_port, start_worker, wait_for_task
from tests.integration.test_replies import read_stream

FINAL = {"succeeded", "failed", "cancelled", "expired"}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_url(log_dir: Path) -> Iterator[str]:
    port = free_port()
    with (log_dir / "fakemodel.log").open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "reach.fakemodel", f"--port={port}", "--delay=0.2"],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            eventually(lambda: _healthy(url), "the fake model answers /healthz", 30, 0.1)
            yield url
        finally:
            process.terminate()
            process.wait(10)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def model_worker(
    settings: Settings, log_dir: Path, model_url: str, system_workers: list[CeleryProcess]
) -> Iterator[CeleryProcess]:
    env = {"REACH_MODEL_URL": model_url}
    process = start_worker(
        settings, "llm.complete", "model", log_dir, env=env, concurrency=50, pool="threads"
    )
    yield process
    process.stop()


def test_a_streamed_completion_sends_each_token_as_an_output_in_order(
    client: httpx.Client, model_worker: CeleryProcess
) -> None:
    prompt = "queues decouple callers from the agents that serve them"
    envelope = {"capability": "llm.complete", "payload": {"prompt": prompt, "stream": True}}
    events = read_stream(client, "POST", "/tasks", json={**envelope, "reply_mode": "stream"})
    tokens = [e["data"]["data"]["token"] for e in events if e["event"] == "output"]  # type: ignore[index]
    assert "".join(tokens) == prompt
    assert len(tokens) == len(prompt.split())
    final = events[-1]
    assert final["event"] == "succeeded"
    assert final["data"]["data"]["result"] == {"text": prompt}  # type: ignore[index]


def test_a_plain_completion_returns_the_text(
    client: httpx.Client, model_worker: CeleryProcess
) -> None:
    envelope = {"capability": "llm.complete", "payload": {"prompt": "hello there"}}
    task = client.post("/tasks", json={**envelope, "reply_mode": "sync"}).json()
    assert task["status"] == "succeeded", task
    assert task["result"] == {"text": "hello there"}


def test_a_model_that_cannot_be_reached_is_retried_then_fails_retryable(
    client: httpx.Client, settings: Settings, log_dir: Path, model_worker: CeleryProcess
) -> None:
    """A worker pointed at a closed port: each attempt fails to connect, and the task ends
    failed with a retryable code once its attempts are spent."""
    nowhere = start_worker(
        settings,
        "llm.complete",
        "model-nowhere",
        log_dir,
        env={"REACH_MODEL_URL": f"http://127.0.0.1:{free_port()}"},
        pool="threads",
    )
    model_worker.stop()  # only the worker that cannot reach the model serves the queue now
    try:
        envelope = {"capability": "llm.complete", "payload": {"prompt": "anyone?"}}
        task_id = client.post("/tasks", json=envelope).json()["task_id"]
        done = wait_for_task(client, task_id, FINAL, timeout_s=60)
    finally:
        nowhere.stop()
    assert done["status"] == "failed"
    assert done["error"]["code"] == "model_unreachable"  # type: ignore[index]
    assert done["error"]["retryable"] is True  # type: ignore[index]
    # naming none of the model's address, which the worker's log has (an audit, 2026-12-06)
    assert "127.0.0.1" not in json.dumps(done["error"])
    assert "cannot be reached" in nowhere.output()
    assert done["attempts"] == 3
