"""Capability names, the key patterns that allow them, and the prefix chain used to route.

A capability name is dotted lowercase (``invoice.extract``); it is also the Celery queue name,
and with Redis as the Celery broker the key of a list in the db that Celery, kombu and
Agent-Reach keep their own keys in. So no name a tenant or an agent sends may spell one of
theirs (a tenant's ``unacked`` once turned kombu's hash into a list and stopped every worker):

- ``reach``, ``reach.*``: the broker's own queues (``reach.maintenance``, ``reach.webhooks``);
- a first segment starting with ``celery``: Celery's default queue ``celery``, event queues
  ``celeryev.<uuid>``, result keys ``celery-task-meta-<id>``;
- a first segment starting with ``unacked``: kombu's ``unacked`` hash, ``unacked_index``
  sorted set and ``unacked_mutex`` lock;
- a ``pidbox`` segment: kombu's mailbox queues (``<oid>.reply.celery.pidbox``);
- ``amq``, ``amq.*``: RabbitMQ's own (it refuses to declare a queue named ``amq.…``, which
  stopped the bridge, and so every remote agent, when one registered such a capability).

The grammar keeps out the rest: ``_kombu.binding.*`` (leading ``_``), ``reach:*`` (``:``),
kombu's priority lists ``<queue>\x06\x16<n>``, card queues ``<capability>@<agent>@<version>``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

NAME_MAX = 128
_SEGMENT = r"[a-z][a-z0-9_-]{0,62}"
_NAME = re.compile(rf"{_SEGMENT}(?:\.{_SEGMENT}){{0,7}}")
_PATTERN = re.compile(rf"\*|(?:{_SEGMENT}\.)*(?:{_SEGMENT}|\*)")
RESERVED_PREFIX = "reach"
_FOREIGN_FIRST = frozenset({"amq"})
_FOREIGN_STEMS = ("celery", "unacked")
_FOREIGN_SEGMENTS = frozenset({"pidbox"})
# The same rules as one ECMA-262 pattern, for the OpenAPI document (with NAME_MAX as its
# maxLength): the reserved names are refused by the lookahead.
NAME_PATTERN = (
    r"^(?!reach(?:\.|$)|amq(?:\.|$)|celery|unacked|(?:[^.]*\.)*pidbox(?:\.|$))"
    rf"{_SEGMENT}(?:\.{_SEGMENT}){{0,7}}$"
)


def is_valid_name(name: str) -> bool:
    return len(name) <= NAME_MAX and _NAME.fullmatch(name) is not None and not is_reserved(name)


def is_reserved(name: str) -> bool:
    """A name Celery, kombu or Agent-Reach keep a key or queue under (see above)."""
    segments = name.split(".")
    return (
        segments[0] == RESERVED_PREFIX
        or segments[0] in _FOREIGN_FIRST
        or segments[0].startswith(_FOREIGN_STEMS)
        or not _FOREIGN_SEGMENTS.isdisjoint(segments)
    )


# A key's or a filter's capability pattern as one ECMA-262 pattern (with NAME_MAX).
PATTERN_PATTERN = rf"^(?:{_PATTERN.pattern})$"


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


def any_pattern_allows(patterns: Sequence[str], name: str) -> bool:
    return any(pattern_allows(p, name) for p in patterns)


def pattern_covers(outer: str, inner: str) -> bool:
    """Whether every name ``inner`` allows, ``outer`` allows too."""
    if inner == "*":
        return outer == "*"
    if inner.endswith(".*"):
        return outer != inner[:-2] and pattern_allows(outer, inner[:-2])
    return pattern_allows(outer, inner)


def patterns_cover(outer: list[str] | tuple[str, ...], inner: list[str] | tuple[str, ...]) -> bool:
    """Whether ``outer`` allows every name that ``inner`` allows; an empty ``inner`` (a filter
    that lets everything through) is covered only by ``*``.

    A wildcard is covered only by one pattern that covers it alone: no finite set of narrower
    patterns allows all of ``invoice`` and every name below it.
    """
    inner = inner or ("*",)
    return all(any(pattern_covers(o, i) for o in outer) for i in inner)


def prefix_chain(name: str) -> list[str]:
    """``invoice.extract.zh`` -> ``[invoice.extract.zh, invoice.extract, invoice]``."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
