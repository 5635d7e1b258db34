"""The Submit form built from a card's input schema, in Chromium: properties without a
description, named like Object's own (``__proto__``), or with a long enum option."""

from __future__ import annotations

import json
from typing import Any

from playwright.sync_api import expect
from sqlalchemy import Engine

from broker.registry import leases
from tests.integration.conftest import KeyMaker
from tests.integration.console.conftest import NARROW, Console
from tests.integration.console.test_screenshots import fits
from workers.sdk.agent import AgentRegistry

LONG_OPTION = "a very long option that an agent's author wrote out in full " * 6
RIGHT_TO_LEFT = "\u202e"  # an override: the text after it, to the end of its element, reversed


def advertise_form_card(engine: Engine, tenant: str) -> str:
    """A card only ``tenant`` is shown, whose schema has the awkward properties."""
    capability = f"test.console-form-{tenant}"
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "__proto__": {"type": "string", "maxLength": 50},
            "colour": {"type": "string", "maxLength": 20, "description": "Any colour"},
            "size": {"type": "string", "enum": ["small", LONG_OPTION]},
            "count": {"type": "integer"},
        },
    }
    cards = AgentRegistry()
    cards.capability(
        capability,
        agent_id=f"form-{tenant}",
        input_schema=schema,
        tenants=[tenant],
        description=f"{RIGHT_TO_LEFT}an agent's words",
    )(lambda ctx, payload: None)
    leases.advertise_cards(engine, [spec.card.document() for spec in cards])
    return capability


def test_the_submit_form_shows_no_null_and_fills_in_no_property_of_object(
    console: Console, make_key: KeyMaker, engine: Engine
) -> None:
    # Given a card with properties without a description, one named __proto__, a long option
    tenant, key = make_key()
    capability = advertise_form_card(engine, tenant)

    # When its form is opened
    page = console.page
    console.sign_in(key)
    expect(page.get_by_role("heading", name="Tasks")).to_be_visible()  # signed in
    console.open(f"#/submit?capability={capability}")
    fields = page.locator("fieldset")
    expect(page.get_by_label("count")).to_be_visible()

    # Then the card's words are isolated: its override reverses nothing past them
    described = page.locator("#capability-description")
    expect(described.locator("bdi")).to_have_count(2)  # the agent's id and the description
    expect(described.locator("bdi").nth(1)).to_have_text(f"{RIGHT_TO_LEFT}an agent's words")
    # and no field says "null", __proto__ starts empty, and the form fits the window
    expect(fields).not_to_contain_text("null")
    expect(fields.get_by_text("Any colour")).to_be_visible()
    expect(page.get_by_label("__proto__")).to_have_value("")
    assert fits(page)
    page.set_viewport_size(NARROW)
    assert fits(page)

    # ... and what is typed into __proto__ is sent as that property of the payload
    page.get_by_label("__proto__").fill("a value")
    page.get_by_label("count").fill("3")
    with page.expect_request(lambda r: r.method == "POST" and r.url.endswith("/tasks")) as sent:
        page.get_by_role("button", name="Submit").click()
    payload = json.loads(sent.value.post_data or "{}")["payload"]
    assert payload == {"__proto__": "a value", "count": 3}
