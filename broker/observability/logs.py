"""Structured logs: one JSON object per line with a stable ``event`` (the message template,
before its arguments are filled in), the level, the logger, and whatever the context carries
(trace id, task id, capability, tenant, agent instance). Human-readable lines in a terminal.

Payloads and secrets are never logged: log their digest and size if anything.

A record is one line whatever it quotes: a tenant's text (a request's path, an agent's error)
may hold a line end or a terminal's escape, which made a line of its own that read as the
broker's, or cleared the operator's screen. Text lines show control characters escaped
(``\\n``, ``\\u001b``), a traceback's lines indented below the record's; JSON lines
escape those JSON leaves raw (U+007F-U+009F, U+2028 and U+2029, which ``str.splitlines``
and terminals read as line ends and escapes).
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

_context: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "reach_log_context", default=None
)
# What no line may carry raw: C0 but the tab, DEL, C1, and the Unicode line and paragraph ends
_CONTROLS = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")
# Of those, what ``json.dumps(ensure_ascii=False)`` writes raw (it escapes C0 itself)
_RAW_IN_JSON = re.compile("[\x7f-\x9f\u2028\u2029]")
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


def current() -> dict[str, Any]:
    return dict(_context.get() or {})


@contextmanager
def bound(**fields: Any) -> Iterator[None]:
    """Add fields to every log line written inside the block (this task, this request)."""
    token = _context.set({**current(), **{k: v for k, v in fields.items() if v is not None}})
    try:
        yield
    finally:
        _context.reset(token)


def bind(**fields: Any) -> None:
    """Add fields for the rest of the current context (a request's middleware uses this)."""
    _context.set({**current(), **{k: v for k, v in fields.items() if v is not None}})


def capture_context() -> None:
    """Make every log record carry the context it was created in (installed once), so a
    handler that formats it later, or elsewhere, still sees the request's trace id."""
    factory = logging.getLogRecordFactory()
    if getattr(factory, "reach", False):
        return

    def create(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = factory(*args, **kwargs)
        record.reach_context = current()
        return record

    create.reach = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(create)


def _context_of(record: logging.LogRecord) -> dict[str, Any]:
    found: dict[str, Any] | None = getattr(record, "reach_context", None)
    return found if found is not None else current()


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": getattr(record, "event", None) or str(record.msg),
            "message": record.getMessage(),
            **_context_of(record),
        }
        line.update(
            {
                k: v
                for k, v in record.__dict__.items()
                if k not in _STANDARD
                and k not in ("event", "reach_context")
                and not k.startswith("_")
            }
        )
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return _RAW_IN_JSON.sub(_escaped, json.dumps(line, default=str, ensure_ascii=False))


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        context = " ".join(f"{k}={v}" for k, v in _context_of(record).items())
        base = f"{self.formatTime(record, '%H:%M:%S')} {record.levelname:<7} {record.name}: "
        text = base + record.getMessage() + (f"  [{context}]" if context else "")
        text = _CONTROLS.sub(_escaped, text)
        if record.exc_info:
            # Lines of its own, each indented: its last line quotes the exception's text
            # (an agent's, a request's), which may hold line ends of its own.
            lines = self.formatException(record.exc_info).splitlines()
            text += "".join(f"\n    {_CONTROLS.sub(_escaped, line)}" for line in lines)
        return text


def _escaped(found: re.Match[str]) -> str:
    """A control character as JSON (and Python) write it escaped."""
    char = found.group()
    return "\\n" if char == "\n" else "\\r" if char == "\r" else f"\\u{ord(char):04x}"


def configure(level: str = "INFO", fmt: str | None = None) -> None:
    """JSON unless stderr is a terminal; ``REACH_LOG_FORMAT=json|text`` decides otherwise."""
    fmt = fmt or os.environ.get("REACH_LOG_FORMAT") or ("text" if sys.stderr.isatty() else "json")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(TextFormatter() if fmt == "text" else JsonFormatter())
    capture_context()
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
