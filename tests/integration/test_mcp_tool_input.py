"""The built-in task tools' bad input, as MCP 2025-11-25 has a tool's input errors: a result
with ``isError`` the model can read and correct, not a JSON-RPC error."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.stack import ServedApp
from tests.integration.test_mcp import MODES, call


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tool", ["reach_get_task", "reach_cancel_task"])
@pytest.mark.parametrize("arguments", [{}, {"task_id": 7}], ids=["no task_id", "a number"])
def test_a_task_tool_without_a_string_task_id_answers_a_tool_error(
    api: ServedApp, tenant: tuple[str, str], mode: str, tool: str, arguments: dict[str, Any]
) -> None:
    answer = call(api, tenant[1], tool, arguments, mode)

    assert answer.is_error
    assert answer.structured_content == {
        "error": {"code": "invalid_parameter", "message": "task_id (a string) is required"}
    }
