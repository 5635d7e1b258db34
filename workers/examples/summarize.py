"""``text.summarize``: splits text into sentences and keeps the most informative ones."""

from __future__ import annotations

from typing import Any

from workers.examples.sentences import split_sentences, summarize
from workers.sdk import Context, agent

INPUT_SCHEMA = {
    "type": "object",
    "required": ["text"],
    "properties": {
        "text": {"type": "string", "minLength": 1, "maxLength": 500_000},
        "max_sentences": {"type": "integer", "minimum": 1, "maximum": 50},
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
    """Report the sentences one by one as progress, then return the summary."""
    sentences = split_sentences(payload["text"])
    chosen = summarize(sentences, payload.get("max_sentences", 3))
    for index, sentence in enumerate(chosen, start=1):
        ctx.progress(round(100 * index / max(len(chosen), 1)), sentence)
    return {"summary": " ".join(chosen), "sentences": chosen, "sentence_count": len(sentences)}
