"""Strict JSON for request bodies: every input Postgres or our renderer would choke on is a 4xx.

Python's ``json`` accepts things that break later: NaN and Infinity (jsonb rejects them),
integers beyond 4,300 digits (ValueError), ``"\\u0000"`` (Postgres rejects NUL in text and
jsonb), lone surrogates (unencodable as UTF-8) and deep nesting (RecursionError).
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from broker.errors import BadRequest

# Python's own limit (sys.int_info.default_max_str_digits): parsing past it is what costs
# quadratic time, and json raises ValueError there. Any integer a client can send as JSON
# below it is accepted, as the OpenAPI document's plain "integer" and "number" say.
MAX_INT_DIGITS = 4300


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise BadRequest("integer too large", code="number_out_of_range")
    return int(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadRequest("number out of range", code="number_out_of_range")
    return value


def _reject_constant(name: str) -> float:
    raise BadRequest(f"{name} is not valid JSON", code="number_out_of_range")


def _check_string(s: str) -> None:
    if "\x00" in s:
        raise BadRequest("strings must not contain NUL (\\u0000)", code="invalid_string")
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(
            "strings must not contain lone surrogates", code="invalid_string"
        ) from None


def check_tree(value: Any, *, max_depth: int) -> None:
    """Walk iteratively (no recursion to exhaust) checking depth and strings."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list) and depth > max_depth:
            raise BadRequest(f"nesting deeper than {max_depth}", code="json_too_deep")
        if isinstance(node, dict):
            for key, child in node.items():
                _check_string(key)
                stack.append((child, depth + 1))
        elif isinstance(node, list):
            stack.extend((child, depth + 1) for child in node)
        elif isinstance(node, str):
            _check_string(node)


def parse(raw: bytes, *, max_depth: int) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("body is not UTF-8", code="invalid_json") from None
    try:
        value = json.loads(
            text,
            parse_int=_parse_int,
            parse_float=_parse_float,
            parse_constant=_reject_constant,
        )
    except RecursionError:
        raise BadRequest(f"nesting deeper than {max_depth}", code="json_too_deep") from None
    except json.JSONDecodeError as exc:
        raise BadRequest(f"invalid JSON: {exc.msg} at {exc.pos}", code="invalid_json") from None
    check_tree(value, max_depth=max_depth)
    return value


def canonical(value: Any) -> bytes:
    """One byte form per JSON value, so equal payloads have equal digests. NaN and the
    infinities are not JSON: a ValueError (an agent that returns one fails `result_invalid`)."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


def digest(value: Any) -> tuple[str, int]:
    """(sha256 hex of the canonical form, its size in bytes)."""
    data = canonical(value)
    return hashlib.sha256(data).hexdigest(), len(data)
