"""JSON on the hot paths: orjson, with Python's ``json`` wherever the two would differ.

A bridge making a thousand calls at once spent about a tenth of its CPU in ``json``: the
events it appends, the calls' bodies, the messages it takes, and the JSON columns psycopg
binds and reads (``broker.db.engines`` gives psycopg these functions). orjson does that work
in a fraction of the time. Where it would not give what ``json`` gives, ``json`` does the
work:

- orjson reads an integer beyond 64 bits as a float, losing digits; ``json`` keeps it
  exact (the API accepts integers of up to 4,300 digits). A text with a run of 19 digits or
  more is read by ``json``. On a text of more than a line, that look is
  ``bytes.translate`` and a substring search: a regular expression for it took twice as long
  as ``json.loads`` itself on a 1 KB run message. On a short text the expression is faster.
- orjson refuses what ``json`` reads (``NaN``, ``1e400``, lone surrogates), and what it
  writes (integers beyond 64 bits, keys that are not strings): ``json`` then does it, and
  raises where it always did, but for nesting deeper than it reads (orjson reads 1,024
  levels): there ``json`` raises RecursionError, and ``loads`` a ValueError, as for any
  text that is not JSON, so that a caller catching that (an agent's answer, a message)
  catches this too.
- orjson writes NaN and the infinities as ``null``, where ``json`` writes invalid JSON, and
  writes datetimes, UUIDs and dataclasses, which ``json`` refuses. Nothing reaches these
  paths with them: the API refuses them, and an agent's result, progress and output are
  checked first (``jsonbody.canonical``).

What is written is compact and UTF-8, as ``json.dumps(..., separators=(",", ":"),
ensure_ascii=False)`` writes it, but for the spelling of some floats (``1e16``, not
``1e+16``): the same values.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_NUMBER = b"0" * 19
_SHORT = 128  # below it, a regular expression looks faster than translate
_LONG_NUMBER_BYTES = re.compile(rb"[0-9]{19}")
_LONG_NUMBER_TEXT = re.compile(r"[0-9]{19}")


def dumps(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError: beyond 64 bits, keys that are not strings
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def dumps_str(value: Any) -> str:
    return dumps(value).decode()


def loads(raw: str | bytes | bytearray | memoryview) -> Any:
    if isinstance(raw, memoryview | bytearray):
        raw = bytes(raw)
    if not has_long_number(raw):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("JSON nested too deep") from None


def has_long_number(raw: str | bytes) -> bool:
    """Whether a run of 19 ASCII digits or more is in ``raw``: an integer that may not fit
    in 64 bits. UTF-8 writes every other character as bytes beyond ASCII, so the digits
    are found in the encoded text too."""
    if isinstance(raw, str):
        if len(raw) < _SHORT:
            return _LONG_NUMBER_TEXT.search(raw) is not None
        raw = raw.encode("utf-8", "surrogatepass")
    elif len(raw) < _SHORT:
        return _LONG_NUMBER_BYTES.search(raw) is not None
    return _LONG_NUMBER in raw.translate(_DIGITS_AS_ZERO)
