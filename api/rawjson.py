"""Answers that pass JSON read from Postgres on as its text, neither decoded nor encoded again.

A task's result or payload may be megabytes of small values. Decoding it into Python objects
and encoding them again took the event loop 0.1 s for a result of 1 MiB of empty lists and
0.65 s for one of 4 MiB (most of it the garbage collector walking the new objects), at a
``GET /tasks/{id}`` any tenant may send many times a second: one tenant's reads stalled
every other request of the process. Postgres writes the column's JSON (``::text``), and the
answer splices that text in as it is (``orjson.Fragment``): the values are the same, written
with Postgres's spaces.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson
from fastapi.responses import Response


def spliced(resource: dict[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """``resource`` with the JSON texts under ``names`` to be written as they are."""
    for name in names:
        if isinstance(resource.get(name), str):
            resource[name] = orjson.Fragment(resource[name])
    return resource


class StoredJSONResponse(Response):
    """A JSON answer whose ``orjson.Fragment`` values are written as they are."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        # Every value of JSON a reader wrote is a fragment: what is left is the resource's
        # own strings, whole numbers and times, which orjson writes as ``json`` does.
        return orjson.dumps(content)
