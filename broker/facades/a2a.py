"""Our tasks as A2A 1.0 sees them, and A2A messages as our envelopes (the A2A facade).

- A2A task id = our task id; ``contextId`` = our session id. A task without a session has a
  context of its own, ``task_<task id>`` (``context_of``): A2A requires one on every task and
  event, made by the server when the message names none. Session ids begin ``sess_``, so it is
  never taken for one: a message naming it is refused (``envelope_fields``), as a task here
  takes one message.
- States: queued SUBMITTED, running WORKING, succeeded COMPLETED, failed FAILED, cancelled
  CANCELED, expired FAILED (its error code says ``timeout``).
- A message picks its capability with ``metadata.capability``; its payload is its first data
  part (a JSON object), else ``{"text": <its text parts, joined by newlines>}``. A file part
  is refused (``ContentNotSupported``): the card offers JSON and plain text only.
- The result is the data artifact ``result``; each ``output`` event is an update of the
  artifact ``output`` (appended after the first). An answer carries at most
  ``ANSWER_DATA_VALUES`` JSON values as data parts: a value past that goes as a text part of
  its JSON (media type ``application/json``), and so does a value nested deeper than
  ``DATA_PART_DEPTH``; ``progress`` is a WORKING status whose message says how far along it
  is.
- A protobuf number is a double: an integer a double does not hold exactly (a result's
  ``10**400``, an id of 20 digits) goes as a string of its digits, never rounded nor refused.

Pure: protobuf in, protobuf out; the facade's handler does the I/O.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator, Mapping
from datetime import datetime
from typing import Any

from a2a.types import (
    Artifact,
    AuthenticationInfo,
    Message,
    Part,
    Role,
    StreamResponse,
    Task,
    TaskArtifactUpdateEvent,
    TaskPushNotificationConfig,
    TaskState,
    TaskStatus,
    TaskStatusUpdateEvent,
)
from google.protobuf import struct_pb2
from google.protobuf.json_format import MessageToDict, ParseDict
from google.protobuf.timestamp_pb2 import Timestamp

from broker import jsonbody
from broker.remote.a2a_json import to_json
from broker.tasks.envelope import OPTIONS
from broker.tasks.events import OUTPUT, PROGRESS, STATUS
from broker.webhooks.events import FINAL_EVENTS
from broker.webhooks.events import PROGRESS as PROGRESS_EVENT

STATES: Mapping[str, TaskState] = {
    "queued": TaskState.TASK_STATE_SUBMITTED,
    "running": TaskState.TASK_STATE_WORKING,
    "succeeded": TaskState.TASK_STATE_COMPLETED,
    "failed": TaskState.TASK_STATE_FAILED,
    "cancelled": TaskState.TASK_STATE_CANCELED,
    "expired": TaskState.TASK_STATE_FAILED,
}
# ListTasks' status filter, back to ours (FAILED is both failed and expired).
STATUSES_OF: Mapping[TaskState, tuple[str, ...]] = {
    TaskState.TASK_STATE_SUBMITTED: ("queued",),
    TaskState.TASK_STATE_WORKING: ("running",),
    TaskState.TASK_STATE_COMPLETED: ("succeeded",),
    TaskState.TASK_STATE_FAILED: ("failed", "expired"),
    TaskState.TASK_STATE_CANCELED: ("cancelled",),
}
RESULT_ARTIFACT, OUTPUT_ARTIFACT = "result", "output"
# Protobuf builds a data part's ``Value`` and the SDK writes it out as JSON in Python, value by
# value: about 5 us a value, on the API's event loop (a result of 750 KB of small values took
# 1.2 s of it for every GetTask). An answer carries at most this many values as data parts.
ANSWER_DATA_VALUES = 4_000
JSON_MEDIA_TYPE = "application/json"
# Protobuf's decoder (upb) takes at most 100 levels of messages, and a JSON object in a data
# part takes three of them (Value, Struct, its field's entry), a list two: an artifact holds
# objects nested 32 deep and no deeper (33 raised DecodeError on every read of the task).
# ``max_json_depth`` may let a result nest up to 500 deep.
DATA_PART_DEPTH = 32
# The context of a task without a session (``context_of``).
TASK_CONTEXT_PREFIX = "task_"
# Every integer up to this is a double exactly.
_EXACT_INT = 2**53


class NotAnEnvelope(ValueError):
    """The message does not say what to run, or with what."""


class ContentNotSupported(NotAnEnvelope):
    """The message holds a part of a kind the card does not take (a file)."""


def envelope_fields(
    message: Message,
    request_metadata: Mapping[str, Any],
    lifted: Mapping[int, Any] | None = None,
    options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The envelope's fields a message gives: ``capability`` and the ``envelope.OPTIONS`` (from
    the message's metadata, else the request's), ``payload`` and ``session_id`` (its
    ``contextId``). ``lifted``: data parts taken out of the request before it was parsed, by
    their place (``payload_of``); ``options``: the ``envelope.OPTIONS`` as the request sent
    them, in place of their reading through protobuf (every number a double)."""
    metadata = to_json(message.metadata) if message.HasField("metadata") else {}
    capability = metadata.get("capability") or request_metadata.get("capability")
    if not isinstance(capability, str) or not capability:
        raise NotAnEnvelope("name the capability to run in the message's metadata.capability")
    fields: dict[str, Any] = {"capability": capability, "payload": payload_of(message, lifted)}
    for name in OPTIONS:
        if name in metadata:
            fields[name] = metadata[name]
        elif name in request_metadata:
            fields[name] = request_metadata[name]
    fields.update(options or {})
    if message.context_id.startswith(TASK_CONTEXT_PREFIX):
        raise NotAnEnvelope(
            "this contextId is the context of one task without a session, and a task here"
            " takes one message: send a new message without contextId, or with a session's"
            " id (POST /sessions) to hold a conversation"
        )
    if message.context_id:
        fields["session_id"] = message.context_id
    return fields


def context_of(task: Mapping[str, Any]) -> str:
    """The task's ``contextId``: its session's id, else a context of its own."""
    session_id: str | None = task.get("session_id")
    return session_id or TASK_CONTEXT_PREFIX + task["task_id"]


def task_of_context(context_id: str) -> str | None:
    """The id of the task whose own context ``context_id`` is (``context_of``), else None."""
    if context_id.startswith(TASK_CONTEXT_PREFIX):
        return context_id.removeprefix(TASK_CONTEXT_PREFIX)
    return None


def payload_of(message: Message, lifted: Mapping[int, Any] | None = None) -> dict[str, Any]:
    """The message's first data part, else its text parts. ``lifted``: data parts the API
    took out of the request before the SDK parsed it, as JSON, by their place among the
    parts (the message holds ``{}`` there): protobuf would take each value through Python.
    Raises ``ContentNotSupported`` for a file part, wherever it is."""
    if any(part.HasField("raw") or part.HasField("url") for part in message.parts):
        raise ContentNotSupported(
            "a file part is not taken here: send JSON as a data part, or text"
        )
    lifted = lifted or {}
    for index, part in enumerate(message.parts):
        if part.HasField("data"):
            value = lifted[index] if index in lifted else to_json(part.data)
            if not isinstance(value, dict):
                raise NotAnEnvelope("a data part must hold a JSON object (the payload)")
            return value
    texts = [part.text for part in message.parts if part.HasField("text")]
    if not texts:
        raise NotAnEnvelope("the message has neither a data part nor a text part")
    return {"text": "\n".join(texts)}


class DataBudget:
    """The JSON values one answer may still carry as data parts (``ANSWER_DATA_VALUES``)."""

    def __init__(self, values: int = ANSWER_DATA_VALUES) -> None:
        self.left = values

    def part(self, value: Any) -> Part:
        """A data part of ``value`` while the answer has values left for it and protobuf can
        hold its depth (``DATA_PART_DEPTH``); else a text part of its JSON, written in C."""
        count = jsonbody.values_in(value, self.left)
        if count > self.left or _nests_deeper_than(value, DATA_PART_DEPTH):
            text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
            return Part(text=text, media_type=JSON_MEDIA_TYPE)
        self.left -= count
        return Part(data=ParseDict(_exact(value), struct_pb2.Value()))


def _nests_deeper_than(value: Any, levels: int) -> bool:
    """Whether ``value`` has objects or lists nested more than ``levels`` deep (the outermost
    is level 1). Walked without recursion; a value within an answer's budget is small."""
    pending = [(value, 1)]
    while pending:
        node, depth = pending.pop()
        if isinstance(node, dict | list):
            if depth > levels:
                return True
            children = node.values() if isinstance(node, dict) else node
            pending.extend((child, depth + 1) for child in children)
    return False


def _struct(value: Mapping[str, Any]) -> struct_pb2.Struct:
    return ParseDict(_exact(dict(value)), struct_pb2.Struct())


def _exact(value: Any) -> Any:
    """``value`` as a protobuf ``Value`` holds it exactly: an integer a double does not hold
    (past 2**53 with digits a double would round, or beyond a double's range, where
    ``ParseDict`` raises OverflowError) as a string of its digits. The API and agents give
    integers of up to 4,300 digits; a number would lose them, or fail the push of a task
    whose result holds one."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if _a_double_holds(value) else str(value)
    if isinstance(value, dict):
        return {key: _exact(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_exact(item) for item in value]
    return value


def _a_double_holds(number: int) -> bool:
    if -_EXACT_INT <= number <= _EXACT_INT:
        return True
    try:
        return float(number) == number
    except OverflowError:
        return False


def _timestamp(iso_time: str | None) -> Timestamp | None:
    if not iso_time:
        return None
    stamp = Timestamp()
    stamp.FromDatetime(datetime.fromisoformat(iso_time))
    return stamp


def _agent_says(task: Mapping[str, Any], text: str) -> Message:
    return Message(
        message_id=str(uuid.uuid4()),
        role=Role.ROLE_AGENT,
        task_id=task["task_id"],
        context_id=context_of(task),
        parts=[Part(text=text)],
    )


def status_of(task: Mapping[str, Any]) -> TaskStatus:
    """The task's A2A status: its state, when it last moved, and a message that says why it
    failed or how far along it is."""
    status = task["status"]
    status_proto = TaskStatus(state=STATES[status])
    moved = task.get("finished_at") or task.get("started_at") or task.get("created_at")
    if (stamp := _timestamp(moved)) is not None:
        status_proto.timestamp.CopyFrom(stamp)
    error, progress = task.get("error"), task.get("progress")
    if error:
        status_proto.message.CopyFrom(_agent_says(task, f"{error['code']}: {error['message']}"))
    elif status == "running" and progress:
        status_proto.message.CopyFrom(_agent_says(task, progress_text(progress)))
    return status_proto


def progress_text(progress: Mapping[str, Any]) -> str:
    percent, message = progress.get("percent"), progress.get("message")
    shown = f"{percent:g}%" if isinstance(percent, int | float) else ""
    return f"{shown} {message}".strip() if message else shown


def result_artifact(result: Any, budget: DataBudget | None = None) -> Artifact:
    part = (budget or DataBudget()).part(result)
    return Artifact(artifact_id=RESULT_ARTIFACT, name=RESULT_ARTIFACT, parts=[part])


def task_of(
    task: Mapping[str, Any], budget: DataBudget | None = None, *, artifacts: bool = True
) -> Task:
    """Our task (as the HTTP API renders it) as an A2A task. Its metadata keeps what A2A has
    no field for: the capability, the error, the progress, the agent that ran it. ``budget``:
    the answer's, when it holds more than this task; ``artifacts``: False leaves the result
    out (ListTasks without ``includeArtifacts``)."""
    a2a = Task(
        id=task["task_id"],
        context_id=context_of(task),
        status=status_of(task),
        metadata=_struct(
            {
                "capability": task["capability"],
                "reach": {
                    name: task.get(name)
                    for name in ("status", "error", "progress", "agent", "attempts", "trace_id")
                },
            }
        ),
    )
    if artifacts and task["status"] == "succeeded":
        a2a.artifacts.append(result_artifact(task.get("result"), budget))
    return a2a


StreamEvent = Task | TaskStatusUpdateEvent | TaskArtifactUpdateEvent


class EventMapper:
    """A task's events (``broker.tasks.events``) as A2A stream events, in order. One per
    stream: it knows whether the ``output`` artifact has begun. ``context_id``: the task's
    (``context_of``)."""

    def __init__(self, task_id: str, context_id: str) -> None:
        self.task_id, self.context_id = task_id, context_id
        self.outputs = 0

    def map(self, event_type: str, data: Any) -> Iterator[StreamEvent]:
        if event_type == STATUS:
            state = STATES.get(str(data.get("status")), TaskState.TASK_STATE_WORKING)
            yield self._status(TaskStatus(state=state))
        elif event_type == PROGRESS:
            status = TaskStatus(state=TaskState.TASK_STATE_WORKING)
            status.message.CopyFrom(
                _agent_says(
                    {"task_id": self.task_id, "session_id": self.context_id},
                    progress_text(data),
                )
            )
            yield self._status(status, metadata={"progress": data})
        elif event_type == OUTPUT:
            self.outputs += 1
            artifact = Artifact(
                artifact_id=OUTPUT_ARTIFACT, name=OUTPUT_ARTIFACT, parts=[DataBudget().part(data)]
            )
            yield TaskArtifactUpdateEvent(
                task_id=self.task_id,
                context_id=self.context_id,
                artifact=artifact,
                append=self.outputs > 1,
            )
        elif event_type in STATES:  # final: the event's data is the task as finished
            if event_type == "succeeded":
                yield TaskArtifactUpdateEvent(
                    task_id=self.task_id,
                    context_id=self.context_id,
                    artifact=result_artifact(data.get("result")),
                    last_chunk=True,
                )
            yield self._status(status_of(data))

    def _status(
        self, status: TaskStatus, metadata: Mapping[str, Any] | None = None
    ) -> TaskStatusUpdateEvent:
        event = TaskStatusUpdateEvent(
            task_id=self.task_id, context_id=self.context_id, status=status
        )
        if metadata:
            event.metadata.CopyFrom(_struct(metadata))
        return event


# -- push notifications: an A2A push config is the task's callback ------------------------

PUSH_EVENTS = (*FINAL_EVENTS, PROGRESS_EVENT)
DEFAULT_PUSH_ID = "default"
# What a push config may hold: about what an HTTP envelope's callback does (a URL of 2,048 and
# its events). It is kept in the task's row, which the tenant's quota counts as 1 KiB, and its
# token and credentials go out as header values with every push.
PUSH_ID_MAX, PUSH_TOKEN_MAX, PUSH_SCHEME_MAX, PUSH_CREDENTIALS_MAX = 64, 512, 32, 1024
_HEADER_VALUE = re.compile(r"[\x20-\x7e]*")
_HTTP_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


class BadPushConfig(ValueError):
    """A push config's field is too long, or holds what a header may not."""


def callback_of(config: TaskPushNotificationConfig) -> dict[str, Any]:
    """The task's callback for a push config: every final event and each progress report,
    delivered as A2A pushes (``push_body``, ``push_headers``). Raises ``BadPushConfig``."""
    _bounded("id", config.id, PUSH_ID_MAX, _HEADER_VALUE)
    _bounded("token", config.token, PUSH_TOKEN_MAX, _HEADER_VALUE)
    a2a: dict[str, Any] = {"id": config.id or DEFAULT_PUSH_ID, "token": config.token or None}
    if config.HasField("authentication") and config.authentication.scheme:
        auth = config.authentication
        _bounded("authentication.scheme", auth.scheme, PUSH_SCHEME_MAX, _HTTP_TOKEN)
        _bounded(
            "authentication.credentials", auth.credentials, PUSH_CREDENTIALS_MAX, _HEADER_VALUE
        )
        a2a["authentication"] = {"scheme": auth.scheme, "credentials": auth.credentials}
    return {"url": config.url, "events": list(PUSH_EVENTS), "a2a": a2a}


def _bounded(field: str, value: str, limit: int, allowed: re.Pattern[str]) -> None:
    if len(value) > limit:
        raise BadPushConfig(f"the push config's {field} is longer than {limit} characters")
    if value and not allowed.fullmatch(value):
        raise BadPushConfig(f"the push config's {field} holds characters a header may not")


def push_config_of(task_id: str, callback: Mapping[str, Any] | None) -> TaskPushNotificationConfig:
    """The push config a task's callback holds (NotAPushConfig when it holds none)."""
    if not callback or not isinstance(callback.get("a2a"), Mapping):
        raise NotAPushConfig(task_id)
    a2a = callback["a2a"]
    config = TaskPushNotificationConfig(
        id=a2a["id"], task_id=task_id, url=callback["url"], token=a2a.get("token") or ""
    )
    if auth := a2a.get("authentication"):
        config.authentication.CopyFrom(
            AuthenticationInfo(scheme=auth["scheme"], credentials=auth.get("credentials", ""))
        )
    return config


class NotAPushConfig(LookupError):
    """The task has no A2A push config (no callback, or one set through the HTTP API)."""


def is_push(callback: Mapping[str, Any] | None) -> bool:
    return bool(callback) and isinstance(callback.get("a2a"), Mapping)  # type: ignore[union-attr]


def push_body(task: Mapping[str, Any]) -> str:
    """What a push carries, as the SDK's own sender sends it: a ``StreamResponse`` holding the
    task as it stands."""
    return json.dumps(MessageToDict(StreamResponse(task=task_of(task))), separators=(",", ":"))


def push_headers(callback: Mapping[str, Any] | None) -> dict[str, str]:
    """The config's token, and its credentials when it gave some (A2A's push headers)."""
    if not is_push(callback):
        return {}
    a2a = callback["a2a"]  # type: ignore[index]
    headers: dict[str, str] = {}
    if a2a.get("token"):
        headers["X-A2A-Notification-Token"] = a2a["token"]
    auth = a2a.get("authentication") or {}
    if auth.get("scheme") and auth.get("credentials"):
        headers["Authorization"] = f"{auth['scheme']} {auth['credentials']}"
    return headers
