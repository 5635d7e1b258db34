"""A value read from Postgres, trusted for a while: routing and the door must not query per
request."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TimedCache:
    """Values read from Postgres, trusted for ``ttl_s``: routing must not query per request."""

    ttl_s: float
    _entries: dict[Any, tuple[float, Any]] = field(default_factory=dict)

    def get(self, key: Any) -> tuple[bool, Any]:
        hit = self._entries.get(key)
        if hit is not None and hit[0] > time.monotonic():
            return True, hit[1]
        return False, None

    def forget(self, key: Any) -> None:
        """Drop ``key``: the next reader reads it again (after this process wrote it)."""
        self._entries.pop(key, None)

    def put(self, key: Any, value: Any) -> Any:
        if len(self._entries) > 10_000:
            self._entries.clear()
        self._entries[key] = (time.monotonic() + self.ttl_s, value)
        return value
