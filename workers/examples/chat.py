"""``chat.reply``: one turn of a conversation kept in its session.

Each turn appends the user's text and the agent's reply to ``state["history"]`` in one write
(one revision per turn) and returns ``{"reply", "turn"}``: ``turn`` is the exchange's place in
the history, 1 for the first. Turns of a session run one at a time, in the order they were
accepted, so each reply can recall the message before it.
"""

from __future__ import annotations

from typing import Any

from broker.errors import AgentFailure
from workers.sdk import Context, agent

INPUT_SCHEMA = {
    "type": "object",
    "required": ["text"],
    "properties": {"text": {"type": "string", "minLength": 1, "maxLength": 4000}},
}


def reply_to(text: str, history: list[dict[str, Any]]) -> str:
    """The agent's answer: what it heard, and what it heard the turn before."""
    heard = [m["text"] for m in history if m.get("role") == "user"]
    if not heard:
        return f"You said: {text}"
    return f"You said: {text} (before that: {heard[-1]})"


@agent.capability(
    "chat.reply",
    agent_id="chat",
    version="1.0.0",
    input_schema=INPUT_SCHEMA,
    timeout_s=30,
    display_name="Chat with a memory",
)
def chat_reply(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    """Reply to ``text``, keeping the conversation in the task's session (``session_id``)."""
    if ctx.session is None:
        raise AgentFailure("chat.reply needs a session_id", code="session_required")
    text = payload["text"]
    said: dict[str, Any] = {}

    def add_turn(state: dict[str, Any]) -> None:
        history = state.setdefault("history", [])
        said["reply"] = reply_to(text, history)
        history.append({"role": "user", "text": text})
        history.append({"role": "agent", "text": said["reply"]})
        said["turn"] = sum(1 for m in history if m.get("role") == "user")

    ctx.session.mutate(add_turn)
    return {"reply": said["reply"], "turn": said["turn"]}
