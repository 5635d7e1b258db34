"""Capability names, the key patterns that allow them, and the prefix chain used to route.

A capability name is dotted lowercase (``invoice.extract``); it is also the Celery queue name.
Names under ``reach.`` are reserved for the broker's own queues.
"""

from __future__ import annotations

import re

NAME_MAX = 128
_SEGMENT = r"[a-z][a-z0-9_-]{0,62}"
_NAME = re.compile(rf"{_SEGMENT}(?:\.{_SEGMENT}){{0,7}}")
_PATTERN = re.compile(rf"\*|(?:{_SEGMENT}\.)*(?:{_SEGMENT}|\*)")
RESERVED_PREFIX = "reach"


def is_valid_name(name: str) -> bool:
    return len(name) <= NAME_MAX and _NAME.fullmatch(name) is not None and not is_reserved(name)


def is_reserved(name: str) -> bool:
    return name == RESERVED_PREFIX or name.startswith(RESERVED_PREFIX + ".")


def is_valid_pattern(pattern: str) -> bool:
    return len(pattern) <= NAME_MAX and _PATTERN.fullmatch(pattern) is not None


def pattern_allows(pattern: str, name: str) -> bool:
    """``*`` allows everything; ``invoice.*`` allows ``invoice`` and all below it."""
    if pattern == "*":
        return True
    if pattern.endswith(".*"):
        stem = pattern[:-2]
        return name == stem or name.startswith(stem + ".")
    return pattern == name


def any_pattern_allows(patterns: list[str] | tuple[str, ...], name: str) -> bool:
    return any(pattern_allows(p, name) for p in patterns)


def prefix_chain(name: str) -> list[str]:
    """``invoice.extract.zh`` -> ``[invoice.extract.zh, invoice.extract, invoice]``."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
