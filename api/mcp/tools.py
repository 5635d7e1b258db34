"""What an MCP host sees of the broker: the tools a key may call, and each call's result.

A capability's tool is named as the capability: MCP tool names allow letters, digits, ``_``,
``-`` and ``.`` (SEP-986, checked by the SDK's ``validate_tool_name``), and a capability name
is dotted lowercase, so no mapping is needed. A capability named like one of the broker's own
tools (``reach_get_task``, ``reach_cancel_task``) is not offered.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from mcp_types import CallToolResult, TextContent, Tool
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
from pydantic import ValidationError

from broker.errors import ReachError
from broker.registry.cards import offered
from broker.registry.schemas import allows_objects
from broker.tasks.resource import SUCCEEDED
from broker.tenancy.keys import Principal

log = logging.getLogger("reach.mcp")
GET_TASK = "reach_get_task"
CANCEL_TASK = "reach_cancel_task"
_TASK_ID_ONLY = {
    "type": "object",
    "properties": {"task_id": {"type": "string", "format": "uuid"}},
    "required": ["task_id"],
    "additionalProperties": False,
}
TASK_TOOLS = [
    Tool(
        name=GET_TASK,
        title="Get an Agent-Reach task",
        description=(
            "The task with this id: its status, progress, and once it has ended its result or "
            "error. Poll it for a tool call that answered with a task id and a status."
        ),
        input_schema=_TASK_ID_ONLY,
    ),
    Tool(
        name=CANCEL_TASK,
        title="Cancel an Agent-Reach task",
        description="Cancel a queued or running task; it ends cancelled. Returns the task.",
        input_schema=_TASK_ID_ONLY,
    ),
]


def capability_tools(
    cards: Mapping[str, Sequence[Mapping[str, Any]]], caller: Principal
) -> list[Tool]:
    """A tool per capability ``caller`` may run, from the newest card it may see."""
    offered_tools = (
        _tool(capability, card)
        for capability, card in offered(cards, caller).items()
        if capability not in (GET_TASK, CANCEL_TASK)
    )
    return [tool for tool in offered_tools if tool is not None]


def _tool(capability: str, card: Mapping[str, Any]) -> Tool | None:
    """The capability's tool; None for a card no MCP tool can show: the listing is every
    capability's at once, and one tool the SDK refused failed it whole, for every key."""
    # The payload is a JSON object whatever the card says; MCP requires an object schema. A
    # card whose schema allows no object (advertised before cards were held to one) takes no
    # payload at all.
    schema = dict(card.get("input_schema") or {})
    if not allows_objects(schema):
        log.warning("MCP: %s's input schema allows no object: not offered", capability)
        return None
    schema["type"] = "object"
    try:
        return Tool(
            name=capability,
            title=card.get("display_name") or capability,
            description=card.get("description") or card.get("display_name") or capability,
            input_schema=schema,
        )
    except ValidationError as exc:
        log.warning("MCP: %s's card makes no tool (%s): not offered", capability, exc)
        return None


def outcome(task: Mapping[str, Any], protocol_version: str) -> CallToolResult:
    """The result of a capability's tool for a task that has ended: its result as structured
    content, or its error with ``isError``."""
    if task["status"] != SUCCEEDED:
        return _result(
            {"task_id": task["task_id"], "status": task["status"], "error": task["error"]},
            is_error=True,
        )
    result = task["result"]
    # Through 2025-11-25 structured content must be an object; the text carries any other.
    structured = result if isinstance(result, dict) else None
    if protocol_version not in HANDSHAKE_PROTOCOL_VERSIONS:
        structured = result
    return CallToolResult(content=[_text(result)], structured_content=structured)


def still_running(task: Mapping[str, Any]) -> CallToolResult:
    """The result of a call whose task is still queued or running when the wait ends."""
    task_id, status = task["task_id"], task["status"]
    hint = f"The task is {status}; call {GET_TASK} with this task_id for its result."
    return CallToolResult(
        content=[_text({"task_id": task_id, "status": status}), TextContent(text=hint)],
        structured_content={"task_id": task_id, "status": status},
    )


def task_view(task: Mapping[str, Any]) -> CallToolResult:
    """The task as the HTTP API renders it."""
    return _result(dict(task))


def refusal(exc: ReachError) -> CallToolResult:
    """A refusal (the key may not, the payload is invalid, the task is not found...) as a
    tool error the model can read: the code and message the HTTP API would give."""
    return _result(
        {"error": {"code": exc.code, "message": exc.message, **exc.details}}, is_error=True
    )


def _result(structured: dict[str, Any], *, is_error: bool = False) -> CallToolResult:
    return CallToolResult(
        content=[_text(structured)], structured_content=structured, is_error=is_error
    )


def _text(value: Any) -> TextContent:
    return TextContent(text=json.dumps(value, ensure_ascii=False, separators=(",", ":")))
