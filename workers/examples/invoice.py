"""``invoice.extract``: number, date, total, currency and seller from invoice text."""

from __future__ import annotations

from typing import Any

from workers.examples.invoice_parser import FIELD_GROUPS, parse_group
from workers.sdk import Context, agent

INPUT_SCHEMA = {
    "type": "object",
    "required": ["text"],
    "properties": {"text": {"type": "string", "minLength": 1, "maxLength": 200_000}},
}


@agent.capability(
    "invoice.extract",
    agent_id="invoice-extractor",
    version="1.0.0",
    input_schema=INPUT_SCHEMA,
    timeout_s=45,
    idempotent=True,
    display_name="Invoice extractor",
)
def extract(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    """Parse the invoice group by group, reporting progress after each group."""
    text = payload["text"]
    fields: dict[str, Any] = {}
    for done, (group, names) in enumerate(FIELD_GROUPS, start=1):
        fields.update(parse_group(text, names))
        ctx.progress(round(100 * done / len(FIELD_GROUPS)), f"parsed {group}")
    return fields
