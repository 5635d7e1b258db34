"""What an MCP host is shown of capabilities and of their tasks (api.mcp.tools)."""

from __future__ import annotations

from typing import Any

from api.mcp import tools
from broker.tasks.backpressure import RateLimited
from broker.tenancy.keys import Principal

CARDS: dict[str, list[dict[str, Any]]] = {
    "echo": [
        {"description": "Only for acme.", "input_schema": None, "tenants": ["acme"]},
        {"description": "Return the payload.", "display_name": "echo", "input_schema": None},
    ],
    "invoice.extract": [
        {
            "description": None,
            "display_name": "Invoice extractor",
            "input_schema": {"properties": {"text": {"type": "string"}}, "required": ["text"]},
        }
    ],
    "test.hidden": [{"description": "acme's own", "input_schema": None, "tenants": ["acme"]}],
    "reach_get_task": [{"description": "an agent's own", "input_schema": None}],
}


def key(*patterns: str) -> Principal:
    return Principal(key_id="k", tenant="t", capabilities=patterns)


def test_a_tool_per_capability_the_key_may_run_named_as_the_capability() -> None:
    assert [t.name for t in tools.capability_tools(CARDS, key("invoice.*"))] == ["invoice.extract"]
    assert [t.name for t in tools.capability_tools(CARDS, key("*"))] == ["echo", "invoice.extract"]


def test_a_tenant_is_offered_only_what_its_cards_let_it_see() -> None:
    acme = Principal(key_id="k", tenant="acme", capabilities=("*",))
    shown = {t.name: t.description for t in tools.capability_tools(CARDS, acme)}
    assert shown == {
        "echo": "Only for acme.",
        "invoice.extract": "Invoice extractor",
        "test.hidden": "acme's own",
    }


def test_the_tool_takes_the_cards_description_and_an_object_schema() -> None:
    echo, invoice = tools.capability_tools(CARDS, key("*"))

    assert echo.description == "Return the payload."
    assert echo.input_schema == {"type": "object"}
    assert invoice.description == "Invoice extractor"
    assert invoice.input_schema["type"] == "object"
    assert invoice.input_schema["required"] == ["text"]


def test_a_result_that_is_not_an_object_is_text_only_for_handshake_era_clients() -> None:
    task = {"task_id": "x", "status": "succeeded", "result": [1, 2], "error": None}

    assert tools.outcome(task, "2025-11-25").structured_content is None
    assert tools.outcome(task, "2026-07-28").structured_content == [1, 2]


def test_a_refusal_carries_the_code_and_details_the_http_api_gives() -> None:
    answer = tools.refusal(RateLimited("slow down", retry_after_s=2))

    assert answer.is_error
    assert answer.structured_content == {
        "error": {"code": "rate_limited", "message": "slow down", "retry_after_s": 2}
    }


def test_a_card_of_several_types_is_offered_as_an_object_and_one_allowing_none_is_not() -> None:
    """The SDK requires an object schema of every tool, and refused the whole listing, for
    every key, for one tool whose schema said ``["object", "null"]``."""
    cards: dict[str, list[dict[str, Any]]] = {
        "test.maybe": [{"description": None, "input_schema": {"type": ["object", "null"]}}],
        "test.array": [{"description": None, "input_schema": {"type": "array"}}],
        "echo": CARDS["echo"],
    }
    offered = {t.name: t for t in tools.capability_tools(cards, key("*"))}
    assert sorted(offered) == ["echo", "test.maybe"]
    assert offered["test.maybe"].input_schema == {"type": "object"}
