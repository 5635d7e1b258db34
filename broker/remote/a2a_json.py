"""A2A's messages (protobuf, ``a2a-sdk`` 1.x) as the JSON a task's output and result hold.

An artifact is ``{"artifact_id", "name"?, "description"?, "parts", "metadata"?}``; a part is
``{"text"}``, ``{"data"}``, ``{"url", "filename"?}`` or ``{"raw": <base64>, "filename"?}``,
with ``media_type`` and ``metadata`` when set. A result is ``{"text", "artifacts"}``: every
text part of the artifacts, in order, joined by newlines (as the SDK's own helpers join
them), and the artifacts.

Protobuf keeps every JSON number as a double, so a whole number comes back as a float; JSON
has no such difference, and whole numbers within 2**53 are given back as integers.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Mapping
from typing import Any

from a2a.types import Artifact, Message, Part, TaskArtifactUpdateEvent, TaskStatus
from a2a.utils.errors import A2A_ERROR_REASONS, A2AError
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message as Protobuf

from broker.errors import AgentFailure

_EXACT = 2**53


def to_json(value: Protobuf) -> Any:
    """A ``Struct`` or ``Value`` as plain JSON, whole numbers as integers."""
    return _whole(MessageToDict(value))


def _whole(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer() and abs(value) <= _EXACT:
        return int(value)
    if isinstance(value, dict):
        return {k: _whole(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_whole(v) for v in value]
    return value


def whole_in_place(value: Any) -> Any:
    """``value``, JSON as our own parse gives it, with its whole floats within 2**53 made
    integers, in place: what ``to_json`` makes of the same value sent through protobuf. A
    client on protobuf (the SDK's) sends 3 as ``3.0``."""
    if not isinstance(value, dict | list):
        return _whole(value)
    pending: list[dict[Any, Any] | list[Any]] = [value]
    while pending:
        node = pending.pop()
        for key, item in node.items() if isinstance(node, dict) else enumerate(node):
            if isinstance(item, float):
                if item.is_integer() and abs(item) <= _EXACT:
                    node[key] = int(item)
            elif isinstance(item, dict | list):
                pending.append(item)
    return value


def part_json(part: Part) -> dict[str, Any]:
    shown: dict[str, Any]
    if part.HasField("text"):
        shown = {"text": part.text}
    elif part.HasField("data"):
        shown = {"data": to_json(part.data)}
    elif part.HasField("url"):
        shown = {"url": part.url}
    else:
        shown = {"raw": base64.b64encode(part.raw).decode("ascii")}
    if part.filename:
        shown["filename"] = part.filename
    if part.media_type:
        shown["media_type"] = part.media_type
    if part.HasField("metadata"):
        shown["metadata"] = to_json(part.metadata)
    return shown


def artifact_json(artifact: Artifact) -> dict[str, Any]:
    shown: dict[str, Any] = {"artifact_id": artifact.artifact_id}
    if artifact.name:
        shown["name"] = artifact.name
    if artifact.description:
        shown["description"] = artifact.description
    shown["parts"] = [part_json(p) for p in artifact.parts]
    if artifact.HasField("metadata"):
        shown["metadata"] = to_json(artifact.metadata)
    return shown


def text_of(parts: Iterable[Part]) -> str:
    return "\n".join(p.text for p in parts if p.HasField("text"))


def update_output(update: TaskArtifactUpdateEvent) -> dict[str, Any]:
    """An artifact update as one ``output`` of the task: the chunk it carries, and whether it
    adds to the artifact's parts so far or is its last."""
    shown = artifact_json(update.artifact)
    if update.append:
        shown["append"] = True
    if update.last_chunk:
        shown["last_chunk"] = True
    return shown


class Artifacts:
    """A task's artifacts as its updates built them, in the order they were first seen: an
    update with ``append`` adds its parts, any other replaces the artifact. They are held
    until the task ends (they are its result), so they may come to ``max_bytes`` at most
    (protobuf's size): an agent appending chunks for ever would otherwise grow them without
    end. Past it, AgentFailure ``agent_protocol``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._by_id: dict[str, Artifact] = {}
        self._sizes: dict[str, int] = {}
        self._size = 0

    def replace_all(self, artifacts: Iterable[Artifact]) -> None:
        self._by_id, self._sizes, self._size = {}, {}, 0
        for artifact in artifacts:
            self._replace(artifact)

    def apply(self, update: TaskArtifactUpdateEvent) -> None:
        artifact = update.artifact
        known = self._by_id.get(artifact.artifact_id)
        if update.append and known is not None:
            self._grow(artifact.artifact_id, artifact.ByteSize())
            known.parts.extend(artifact.parts)
        else:
            self._replace(artifact)

    def _replace(self, artifact: Artifact) -> None:
        self._grow(
            artifact.artifact_id, artifact.ByteSize() - self._sizes.get(artifact.artifact_id, 0)
        )
        self._by_id[artifact.artifact_id] = _copy(artifact)

    def _grow(self, artifact_id: str, by: int) -> None:
        if self._size + by > self.max_bytes:
            raise AgentFailure("the agent's artifacts are too large", code="agent_protocol")
        self._size += by
        self._sizes[artifact_id] = self._sizes.get(artifact_id, 0) + by

    @property
    def size(self) -> int:
        """Their size, as protobuf counts it."""
        return self._size

    def result(self) -> dict[str, Any]:
        artifacts = list(self._by_id.values())
        return {
            "text": "\n".join(t for a in artifacts if (t := text_of(a.parts))),
            "artifacts": [artifact_json(a) for a in artifacts],
        }


def _copy(artifact: Artifact) -> Artifact:
    copied = Artifact()
    copied.CopyFrom(artifact)
    return copied


def message_result(message: Message) -> dict[str, Any]:
    """An agent that answers with a message, not a task: its parts are the one artifact."""
    artifact = Artifact(artifact_id=message.message_id, parts=message.parts)
    return {"text": text_of(message.parts), "artifacts": [artifact_json(artifact)]}


def percent_of(metadata: Mapping[str, Any], status: TaskStatus) -> float | None:
    """How far along a status update says the task is, when it says: ``percent`` in the
    update's metadata or its message's (A2A itself has no such field)."""
    candidates = [metadata.get("percent")]
    if status.HasField("message") and status.message.HasField("metadata"):
        candidates.append(to_json(status.message.metadata).get("percent"))
    for value in candidates:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(min(100.0, max(0.0, value)))
    return None


def error_code(exc: A2AError) -> str:
    """``a2a_<reason>`` for an error the agent answered (``a2a_task_not_found``, ...)."""
    reason = A2A_ERROR_REASONS.get(type(exc), "error")
    return f"a2a_{reason.lower()}"
