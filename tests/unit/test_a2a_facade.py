"""The A2A facade's mapping: messages to envelopes, our tasks and events to A2A's."""

from __future__ import annotations

import json
from typing import Any

import pytest
from a2a.types import (
    AuthenticationInfo,
    Message,
    Part,
    TaskArtifactUpdateEvent,
    TaskPushNotificationConfig,
    TaskState,
    TaskStatusUpdateEvent,
)
from google.protobuf import struct_pb2
from google.protobuf.json_format import ParseDict

from broker.facades import a2a
from broker.remote.a2a_json import to_json


def task(status: str, **fields: Any) -> dict[str, Any]:
    return {
        "task_id": "0b0c5f0e-0000-7000-8000-000000000001",
        "capability": "echo",
        "status": status,
        "progress": None,
        "result": None,
        "error": None,
        "attempts": 1,
        "agent": None,
        "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736",
        "session_id": None,
        "created_at": "2026-12-01T08:00:00+00:00",
        "started_at": None,
        "finished_at": None,
        **fields,
    }


def message(*parts: Part, capability: str | None = "echo", context: str = "") -> Message:
    sent = Message(message_id="m1", parts=list(parts), context_id=context)
    if capability is not None:
        sent.metadata.update({"capability": capability})
    return sent


def data(value: Any) -> Part:
    return Part(data=ParseDict(value, struct_pb2.Value()))


def test_the_first_data_part_is_the_payload_and_the_context_the_session() -> None:
    fields = a2a.envelope_fields(
        message(Part(text="ignored"), data({"n": 2}), data({"n": 3}), context="sess_1"), {}
    )
    assert fields == {"capability": "echo", "payload": {"n": 2}, "session_id": "sess_1"}


def test_text_parts_are_joined_when_there_is_no_data_part() -> None:
    fields = a2a.envelope_fields(message(Part(text="a"), Part(text="b")), {})
    assert fields["payload"] == {"text": "a\nb"}


def test_the_request_metadata_may_name_the_capability() -> None:
    fields = a2a.envelope_fields(message(Part(text="x"), capability=None), {"capability": "ocr"})
    assert fields["capability"] == "ocr"


@pytest.mark.parametrize(
    "sent",
    [
        message(Part(text="x"), capability=None),
        message(data([1, 2])),
        message(),
    ],
)
def test_a_message_that_does_not_say_what_to_run_is_refused(sent: Message) -> None:
    with pytest.raises(a2a.NotAnEnvelope):
        a2a.envelope_fields(sent, {})


@pytest.mark.parametrize(
    ("status", "state"),
    [
        ("queued", TaskState.TASK_STATE_SUBMITTED),
        ("running", TaskState.TASK_STATE_WORKING),
        ("succeeded", TaskState.TASK_STATE_COMPLETED),
        ("failed", TaskState.TASK_STATE_FAILED),
        ("cancelled", TaskState.TASK_STATE_CANCELED),
        ("expired", TaskState.TASK_STATE_FAILED),
    ],
)
def test_each_status_has_its_state(status: str, state: TaskState) -> None:
    assert a2a.task_of(task(status)).status.state == state


def test_a_finished_task_carries_its_result_as_a_data_artifact() -> None:
    done = a2a.task_of(task("succeeded", result={"total": 10}, session_id="sess_9"))
    assert done.context_id == "sess_9"
    assert [a.artifact_id for a in done.artifacts] == ["result"]
    assert to_json(done.artifacts[0].parts[0].data) == {"total": 10}
    assert to_json(done.metadata)["capability"] == "echo"


def test_a_failure_says_why_in_the_status_message() -> None:
    error = {"code": "timeout", "message": "deadline passed", "retryable": False}
    failed = a2a.task_of(task("expired", error=error))
    assert failed.status.message.parts[0].text == "timeout: deadline passed"


def test_events_map_in_order_and_outputs_append_after_the_first() -> None:
    mapper = a2a.EventMapper("t1", "")
    mapped = [
        *mapper.map("status", {"status": "running"}),
        *mapper.map("progress", {"percent": 50, "message": "half"}),
        *mapper.map("output", {"i": 1}),
        *mapper.map("output", {"i": 2}),
        *mapper.map("succeeded", task("succeeded", result={"ok": True})),
    ]
    kinds = [type(e).__name__ for e in mapped]
    assert kinds == [
        "TaskStatusUpdateEvent",
        "TaskStatusUpdateEvent",
        "TaskArtifactUpdateEvent",
        "TaskArtifactUpdateEvent",
        "TaskArtifactUpdateEvent",
        "TaskStatusUpdateEvent",
    ]
    progress = mapped[1]
    assert isinstance(progress, TaskStatusUpdateEvent)
    assert progress.status.message.parts[0].text == "50% half"
    first, second, result = mapped[2], mapped[3], mapped[4]
    assert isinstance(first, TaskArtifactUpdateEvent) and not first.append
    assert isinstance(second, TaskArtifactUpdateEvent) and second.append
    assert isinstance(result, TaskArtifactUpdateEvent)
    assert (result.artifact.artifact_id, result.last_chunk) == ("result", True)
    last = mapped[-1]
    assert isinstance(last, TaskStatusUpdateEvent)
    assert last.status.state == TaskState.TASK_STATE_COMPLETED


def test_a_push_config_round_trips_through_the_callback_with_its_headers() -> None:
    config = TaskPushNotificationConfig(task_id="t1", url="https://h.example/p", token="tk")
    config.authentication.CopyFrom(AuthenticationInfo(scheme="Bearer", credentials="c"))
    callback = a2a.callback_of(config)
    assert callback["url"] == "https://h.example/p"
    assert "task.succeeded" in callback["events"] and "task.progress" in callback["events"]
    back = a2a.push_config_of("t1", callback)
    assert (back.id, back.token, back.authentication.credentials) == ("default", "tk", "c")
    assert a2a.push_headers(callback) == {
        "X-A2A-Notification-Token": "tk",
        "Authorization": "Bearer c",
    }
    body = json.loads(a2a.push_body(task("succeeded", result=1)))
    assert body["task"]["status"]["state"] == "TASK_STATE_COMPLETED"


def test_a_callback_set_through_the_http_api_is_no_push_config() -> None:
    plain = {"url": "https://h.example/p", "events": ["task.succeeded"]}
    assert not a2a.is_push(plain) and a2a.push_headers(plain) == {}
    with pytest.raises(a2a.NotAPushConfig):
        a2a.push_config_of("t1", plain)


def test_an_answer_carries_its_values_as_data_until_its_budget_then_json_text() -> None:
    budget = a2a.DataBudget(10)
    first = budget.part({"a": [1, 2, 3]})  # 4 values
    second = budget.part([1, 2, 3, 4, 5, 6, 7])  # 7: past the 6 left
    third = budget.part({"b": 1, "c": 2})  # 2: within them
    assert to_json(first.data) == {"a": [1, 2, 3]}
    assert (second.text, second.media_type) == ("[1,2,3,4,5,6,7]", a2a.JSON_MEDIA_TYPE)
    assert to_json(third.data) == {"b": 1, "c": 2}
    assert budget.left == 4


def test_a_result_past_the_answers_values_is_its_exact_json_text() -> None:
    result = {"n": 10**30, "rows": list(range(a2a.ANSWER_DATA_VALUES)), "s": "é"}
    (part,) = a2a.task_of(task("succeeded", result=result)).artifacts[0].parts
    assert part.media_type == a2a.JSON_MEDIA_TYPE
    assert json.loads(part.text) == result


def test_a_listed_task_leaves_its_result_out_unless_asked() -> None:
    done = task("succeeded", result={"total": 10})
    assert list(a2a.task_of(done, artifacts=False).artifacts) == []
    assert len(a2a.task_of(done).artifacts) == 1


def test_a_lifted_data_part_is_the_payload_as_parsed() -> None:
    sent = Message(parts=[Part(text="t"), Part(data=ParseDict({}, struct_pb2.Value()))])
    assert a2a.payload_of(sent, {1: {"id": 2**60 + 1}}) == {"id": 2**60 + 1}
    assert a2a.payload_of(sent) == {}


def test_a_task_without_a_session_has_a_context_of_its_own_and_a_session_its_id() -> None:
    alone = a2a.task_of(task("failed", error={"code": "x", "message": "y", "retryable": False}))
    in_session = a2a.task_of(task("queued", session_id="sess_9"))

    assert alone.context_id == a2a.TASK_CONTEXT_PREFIX + alone.id
    assert alone.status.message.context_id == alone.context_id
    assert a2a.task_of_context(alone.context_id) == alone.id
    assert in_session.context_id == "sess_9"
    assert a2a.task_of_context("sess_9") is None


def test_a_message_naming_a_tasks_own_context_continues_nothing() -> None:
    sent = message(Part(text="again"), context=a2a.TASK_CONTEXT_PREFIX + "0b0c5f0e")
    with pytest.raises(a2a.NotAnEnvelope, match="one task without a session"):
        a2a.envelope_fields(sent, {})


@pytest.mark.parametrize(
    "parts",
    [
        [Part(url="https://h.example/a.pdf")],
        [Part(text="read this"), Part(raw=b"%PDF-", media_type="application/pdf")],
        [data({"n": 1}), Part(url="https://h.example/a.pdf")],
    ],
    ids=["a file alone", "a file beside text", "a file beside data"],
)
def test_a_file_part_is_content_not_supported(parts: list[Part]) -> None:
    with pytest.raises(a2a.ContentNotSupported):
        a2a.envelope_fields(message(*parts), {})
