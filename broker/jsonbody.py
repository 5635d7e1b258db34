"""Strict JSON for request bodies: every input Postgres or our renderer would choke on is a 4xx.

Python's ``json`` accepts things that break later: NaN and Infinity (jsonb rejects them),
integers beyond 4,300 digits (ValueError), ``"\\u0000"`` (Postgres rejects NUL in text and
jsonb), lone surrogates (unencodable as UTF-8) and deep nesting (RecursionError).

``parse`` decides at C speed (a hook in Python per integer, or a walk over every string, cost
a 1 MiB body several times the parse): the depth on the containers alone, then the strings on
the text; a text that holds a suspect escape has its value written out again by ``json.dumps``,
whose output says exactly whether a string holds NUL or a lone surrogate. A body refused costs
what one accepted does. A body both too deep and with a bad string is refused as too deep.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
from collections import Counter
from itertools import chain, compress
from typing import Any

from broker.errors import BadRequest

# Python's own limit (sys.int_info.default_max_str_digits): parsing past it is what costs
# quadratic time, and json raises ValueError there. Any integer a client can send as JSON
# below it is accepted, as the OpenAPI document's plain "integer" and "number" say.
MAX_INT_DIGITS = 4300

# A decoded string can hold NUL or a surrogate only through a \u escape: the body is strict
# UTF-8 (no raw surrogate) and json refuses raw control characters. Bytes patterns, as the
# text is ASCII wherever they match; none can backtrack.
_SUSPECT_ESCAPE = re.compile(rb"\\u(?:0000|[dD][89a-fA-F])")
_SURROGATE_PAIR = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
_CONTAINER_TYPES = frozenset((dict, list))

# The exponent of a number ``json.dumps`` writes in exponent form (a float): a digit, ``e``,
# a signed exponent of 2 or 3 digits, then what ends a value. Matched in a string too (a
# count too high, never too low). Its mantissa is left out: ``sent_size`` needs only the
# exponent, and matching it cost the expression three times as long on a text of digits.
_EXPONENT = re.compile(rb"[0-9]e([-+][0-9]{2,3})(?=[,\]}]|\Z)")
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")


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


def _too_deep(max_depth: int) -> BadRequest:
    return BadRequest(f"nesting deeper than {max_depth}", code="json_too_deep")


def check_tree(value: Any, *, max_depth: int) -> None:
    """Walk iteratively (no recursion to exhaust) checking depth and strings."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list) and depth > max_depth:
            raise _too_deep(max_depth)
        if isinstance(node, dict):
            for key, child in node.items():
                _check_string(key)
                stack.append((child, depth + 1))
        elif isinstance(node, list):
            stack.extend((child, depth + 1) for child in node)
        elif isinstance(node, str):
            _check_string(node)


def check_depth(value: Any, *, max_depth: int) -> None:
    """``json_too_deep`` when ``value``, as ``parse`` gives it, nests deeper than ``max_depth``."""
    _check_depth(value, max_depth=max_depth)


# A payload sits at the second level of a ``POST /tasks`` body: every door holds it to the depth
# it would have there (``check_payload_depth``).
PAYLOAD_LEVEL = 1


def check_payload_depth(payload: Any, *, max_depth: int) -> None:
    """``json_too_deep`` unless ``payload`` fits in a ``POST /tasks`` body of ``max_depth``
    levels. The A2A and MCP doors measured it within bodies of their own: a payload nested 28
    deep was refused through A2A, and one 32 deep taken through MCP, which ``POST /tasks``
    (and the console, sending it again) refuses."""
    try:
        _check_depth(payload, max_depth=max_depth - PAYLOAD_LEVEL)
    except BadRequest:
        raise _too_deep(max_depth) from None


def _check_depth(value: Any, *, max_depth: int) -> None:
    """``check_tree``'s depth check alone, on what ``json.loads`` built (dicts and lists, no
    subclass), a level at a time: each level's children listed, and the containers among
    them picked, by C loops."""
    dicts = [value] if type(value) is dict else []
    lists = [value] if type(value) is list else []
    for _ in range(max_depth):
        children = [*chain.from_iterable(lists), *chain.from_iterable(map(dict.values, dicts))]
        containers = list(
            compress(children, map(_CONTAINER_TYPES.__contains__, map(type, children)))
        )
        if not containers:
            return
        dicts = [node for node in containers if type(node) is dict]
        lists = [node for node in containers if type(node) is list]
    raise _too_deep(max_depth)


def _check_strings(value: Any) -> None:
    """``_check_string`` on every string of ``value`` (keys too), at C speed: ``json.dumps``
    writes NUL as ``\\u0000`` and a backslash as two, and keeps a lone surrogate, which
    UTF-8 then refuses."""
    text = json.dumps(value, ensure_ascii=False, check_circular=False)
    if "\\u0000" in text.replace("\\\\", "__"):
        raise BadRequest("strings must not contain NUL (\\u0000)", code="invalid_string")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(
            "strings must not contain lone surrogates", code="invalid_string"
        ) from None


def _strings_clean(raw: bytes) -> bool:
    """Whether no string of ``raw``, valid JSON, decodes to NUL or a lone surrogate: False
    may be wrong (a duplicate key drops its value), True never is.

    Each escaped backslash is blanked first, so every backslash left starts an escape; then
    the escaped pairs are taken out as json pairs them (a high surrogate with the low one
    right after it), and any surrogate escape left is lone."""
    if _SUSPECT_ESCAPE.search(raw) is None:
        return True
    escapes = raw.replace(b"\\\\", b"__")
    if b"\\u0000" in escapes:
        return False
    return _SURROGATE.search(_SURROGATE_PAIR.sub(b"", escapes)) is None


def _loads(text: str, *, max_depth: int) -> Any:
    # Python refuses integers past its limit by itself, without a hook called per integer,
    # when that limit is ours (it can be set otherwise: then the hook decides).
    parse_int = None if sys.get_int_max_str_digits() == MAX_INT_DIGITS else _parse_int
    try:
        return json.loads(
            text, parse_int=parse_int, parse_float=_parse_float, parse_constant=_reject_constant
        )
    except RecursionError:
        raise _too_deep(max_depth) from None
    except json.JSONDecodeError as exc:
        raise BadRequest(f"invalid JSON: {exc.msg} at {exc.pos}", code="invalid_json") from None
    except ValueError:  # an integer past Python's limit: nothing else raises it
        raise BadRequest("integer too large", code="number_out_of_range") from None


def parse(raw: bytes, *, max_depth: int) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("body is not UTF-8", code="invalid_json") from None
    value = _loads(text, max_depth=max_depth)
    if raw.count(b"[") + raw.count(b"{") > max_depth:  # fewer containers: none that deep
        _check_depth(value, max_depth=max_depth)
    if not _strings_clean(raw):
        _check_strings(value)
    return value


def written(value: Any, *, max_depth: int) -> bytes:
    """``canonical(value)``, for a value no body brought (an agent's result, output or session
    state), refused (BadRequest, with ``parse``'s codes) where a body would be: a string
    holding NUL or a lone surrogate, nesting past ``max_depth``. A TypeError or ValueError
    when it is not JSON at all (NaN, the infinities, a set). At C speed: ``json.dumps`` writes
    NUL as ``\\u0000`` and a backslash as two, and UTF-8 has no surrogate."""
    try:
        data = canonical(value)
    except RecursionError:
        raise _too_deep(max_depth) from None
    except UnicodeEncodeError:
        raise BadRequest(
            "strings must not contain lone surrogates", code="invalid_string"
        ) from None
    if b"\\u0000" in data and b"\\u0000" in data.replace(b"\\\\", b"__"):
        raise BadRequest("strings must not contain NUL (\\u0000)", code="invalid_string")
    if data.count(b"[") + data.count(b"{") > max_depth:  # fewer containers: none that deep
        _check_depth(json.loads(data), max_depth=max_depth)
    return data


def canonical(value: Any) -> bytes:
    """One byte form per JSON value, so equal payloads have equal digests. NaN and the
    infinities are not JSON: a ValueError (an agent that returns one fails `result_invalid`)."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


def sent_size(data: bytes) -> int:
    """The bytes of ``data`` (``canonical``'s) as the API sends it back once Postgres has kept
    it, or a few more: what a limit, a quota or a stored size must count.

    jsonb keeps a number as numeric, whose text has no exponent: ``1e+308`` comes back as 309
    digits (read as an integer and sent whole: 16 KB of metadata went out as 713 KB),
    ``1e-300`` as ``0.`` and 300 digits. So a number in exponent form counts the length of
    that text: exactly when its mantissa has no fraction, at most 17 bytes more when it has
    one. The text is scanned only if a digit, ``e`` and a signed digit follow each other
    somewhere (``translate`` and a substring search, about 1 ms a megabyte), and the
    exponents are tallied in C: a megabyte of floats costs one pass of the expression (10 to
    35 ms), not a step in Python per number."""
    shape = data.translate(_DIGITS_AS_ZERO)
    if b"0e+0" not in shape and b"0e-0" not in shape:
        return len(data)
    extra = 0
    for exponent, count in Counter(_EXPONENT.findall(data)).items():
        # A token of 1 + F + 1 + len(exponent) bytes (F: the point and its fraction) turns
        # into 1 + E digits (E > 0) or into 0. + |E| - 1 zeros + the digits (E < 0).
        power = int(exponent)
        lost = 2 if power > 0 else 1
        extra += count * max(abs(power) - lost - (len(exponent) - 1), 0)
    return len(data) + extra


def digest(value: Any) -> tuple[str, int]:
    """(sha256 hex of the canonical form, its ``sent_size``)."""
    data = canonical(value)
    return hashlib.sha256(data).hexdigest(), sent_size(data)


def more_values_than(payload: Any, limit: int) -> bool:
    """Whether ``payload`` holds more than ``limit`` JSON values, counting no further."""
    return values_in(payload, limit) > limit


def values_in(payload: Any, limit: int) -> int:
    """The JSON values ``payload`` holds (its containers' members, at every depth), counting
    no further than past ``limit``."""
    seen, pending = 0, [payload]
    while pending:
        node = pending.pop()
        if isinstance(node, dict | list):
            seen += len(node)
            if seen > limit:
                return seen
            pending.extend(node.values() if isinstance(node, dict) else node)
    return seen


def whole(value: Any) -> Any:
    """A JSON number without a fraction as the integer it is (``60.0``, ``6e1``): JSON
    Schema's ``integer`` counts them, and ``json.dumps(60.0)`` sends one; a strict model alone
    refused them. Anything else is left to the model (a string or ``true`` stays refused).
    A strict model's ``mode="before"`` validator of its integer fields: a type with the
    validator in it wrote its bounds into the JSON Schema as ``ge``/``le``."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value
