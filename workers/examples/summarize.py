"""``text.summarize``: splits text into sentences and keeps the most informative ones."""

from __future__ import annotations

import time
from typing import Any

from workers.examples.sentences import split_sentences, summarize
from workers.sdk import Context, agent

INPUT_SCHEMA = {
    "type": "object",
    "required": ["text"],
    "properties": {
        "text": {"type": "string", "minLength": 1, "maxLength": 500_000},
        "max_sentences": {"type": "integer", "minimum": 1, "maximum": 50},
        "delay_s": {"type": "number", "minimum": 0, "maximum": 2},
    },
}


@agent.capability(
    "text.summarize",
    agent_id="summarizer",
    version="1.0.0",
    input_schema=INPUT_SCHEMA,
    timeout_s=60,
    idempotent=True,
    streaming=True,
    display_name="Extractive summarizer",
)
def summarize_text(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    """Stream the chosen sentences one by one as outputs, then return the summary.

    ``delay_s`` (at most 2) waits between sentences, so a stream shows them arriving.
    """
    sentences = split_sentences(payload["text"])
    chosen = summarize(sentences, payload.get("max_sentences", 3))
    delay_s = float(payload.get("delay_s", 0))
    for index, sentence in enumerate(chosen, start=1):
        ctx.emit({"index": index, "sentence": sentence})
        ctx.progress(round(100 * index / max(len(chosen), 1)), f"sentence {index} of {len(chosen)}")
        if delay_s and index < len(chosen):
            time.sleep(delay_s)
    return {"summary": " ".join(chosen), "sentences": chosen, "sentence_count": len(sentences)}
