"""``jsonbody.parse`` decides at C speed, and answers what the walk over every node did: the
same value, or the same refusal (code and message), but that a body both too deep and with a bad
string is refused as too deep, and of a NUL and a lone surrogate the NUL is named (the walk named
whichever it met first: a refused body cost it the whole walk)."""

from __future__ import annotations

import json
import math
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from broker import jsonbody
from broker.errors import BadRequest

DEPTH = 32


def walked(raw: bytes, *, max_depth: int) -> Any:
    """The parse before the fast path, kept as the reference: a Python hook per integer and
    a walk over every node, the depth first, then the strings, NUL before lone surrogates."""

    def parse_int(text: str) -> int:
        if len(text.lstrip("-")) > 4300:
            raise BadRequest("integer too large", code="number_out_of_range")
        return int(text)

    def parse_float(text: str) -> float:
        if not math.isfinite(value := float(text)):
            raise BadRequest("number out of range", code="number_out_of_range")
        return value

    def reject_constant(name: str) -> float:
        raise BadRequest(f"{name} is not valid JSON", code="number_out_of_range")

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("body is not UTF-8", code="invalid_json") from None
    try:
        tree = json.loads(
            text, parse_int=parse_int, parse_float=parse_float, parse_constant=reject_constant
        )
    except RecursionError:
        raise BadRequest(f"nesting deeper than {max_depth}", code="json_too_deep") from None
    except json.JSONDecodeError as exc:
        raise BadRequest(f"invalid JSON: {exc.msg} at {exc.pos}", code="invalid_json") from None
    strings: list[str] = []
    stack: list[tuple[Any, int]] = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list) and depth > max_depth:
            raise BadRequest(f"nesting deeper than {max_depth}", code="json_too_deep")
        if isinstance(node, dict):
            strings += node
            stack += [(child, depth + 1) for child in node.values()]
        elif isinstance(node, list):
            stack += [(child, depth + 1) for child in node]
        elif isinstance(node, str):
            strings.append(node)
    if any("\x00" in s for s in strings):
        raise BadRequest("strings must not contain NUL (\\u0000)", code="invalid_string")
    for s in strings:
        jsonbody._check_string(s)
    return tree


def outcome(parse: Callable[..., Any], raw: bytes, max_depth: int = DEPTH) -> tuple[str, str]:
    """("ok", the value's repr: -0.0 apart from 0) or (the code, the message)."""
    try:
        return "ok", repr(parse(raw, max_depth=max_depth))
    except BadRequest as exc:
        return exc.code, exc.message


def nested(depth: int, opening: bytes = b"[", closing: bytes = b"]") -> bytes:
    return opening * depth + closing * depth


def nested_objects(depth: int, inner: bytes = b"{}") -> bytes:
    return b'{"a":' * (depth - 1) + inner + b"}" * (depth - 1)


def string(escaped: bytes) -> bytes:
    return b'"' + escaped + b'"'


CORPUS: list[tuple[bytes, str]] = [
    # strings: what an escape decodes to, with the backslashes before it counted
    (string(b"\\u0000"), "invalid_string"),
    (string(b"\\\\u0000"), "ok"),  # an escaped backslash, then the text u0000
    (string(b"\\\\\\u0000"), "invalid_string"),  # an escaped backslash, then a NUL
    (string(b"\\\\\\\\u0000"), "ok"),
    (string(b"\\u005Cu0000"), "ok"),  # a backslash written as \u005C, then the text u0000
    (string(b"\\u005c\\u0000"), "invalid_string"),
    (string(b"\\ud83d\\ude00"), "ok"),  # a pair
    (string(b"\\uD83D\\uDE00"), "ok"),
    (string(b"\\ud83d"), "invalid_string"),
    (string(b"\\ude00"), "invalid_string"),
    (string(b"\\ude00\\ud83d"), "invalid_string"),  # low then high: two lone halves
    (string(b"\\ud83d\\ud83d\\ude00"), "invalid_string"),  # a lone high, then a pair
    (string(b"\\ud83d\\ude00\\ude00"), "invalid_string"),  # a pair, then a lone low
    (string(b"\\ud83d\\\\\\ude00"), "invalid_string"),  # a backslash between the halves
    (string(b"\\ud83dx\\ude00"), "invalid_string"),
    (string(b"\\\\ud83d\\ude00"), "invalid_string"),  # the text ud83d, then a lone low
    (string(b"\\\\ud800"), "ok"),
    (string(b"\\ud7ff\\ue000"), "ok"),  # just outside the surrogates
    (b'{"\\ud800": 1}', "invalid_string"),
    (b'{"k\\u0000": 1}', "invalid_string"),
    (b'{"a": "\\u0000", "a": 1}', "ok"),  # the NUL's value is replaced by the duplicate key
    (b'{"a": "\\ud800", "b": "\\u0000"}', "invalid_string"),
    (b'["\\u0000", "\\ud800"]', "invalid_string"),  # the NUL is named, whichever comes first
    (b'["\\ud800", "\\u0000"]', "invalid_string"),
    ('"Zoë 你好 😀"'.encode(), "ok"),
    (string(b'\\u00e9\\u4f60\\t\\n\\\\\\/\\"'), "ok"),
    (string(b"\\u"), "invalid_json"),
    (string(b"\\u00"), "invalid_json"),
    (b'"a\x00b"', "invalid_json"),  # a raw control character
    # numbers
    (b"1" * 4300, "ok"),
    (b"-" + b"9" * 4300, "ok"),
    (b"1" * 4301, "number_out_of_range"),
    (b"-" + b"9" * 4301, "number_out_of_range"),
    (b"[" + b"1" * 5000 + b', "\\u0000"]', "number_out_of_range"),  # the parse stops first
    (b"[" + b"1" * 4300 + b".5]", "number_out_of_range"),  # a float: past 1e308
    (b"0." + b"1" * 5000, "ok"),
    (b"1e308", "ok"),
    (b"1e309", "number_out_of_range"),
    (b"-1e309", "number_out_of_range"),
    (b"1" * 400 + b".0", "number_out_of_range"),
    (b"-0.0", "ok"),
    (b"-0", "ok"),
    (b"1e-999", "ok"),
    (b"[NaN]", "number_out_of_range"),
    (b"-Infinity", "number_out_of_range"),
    # nesting
    (nested(DEPTH), "ok"),
    (nested(DEPTH + 1), "json_too_deep"),
    (nested_objects(DEPTH), "ok"),
    (nested_objects(DEPTH + 1), "json_too_deep"),
    (b"[" + b"[1, 2], " * 40 + b"{}]", "ok"),  # many containers, none deep
    (b'[{"a":' * 15 + b"[1, {}]" + b"}]" * 15, "ok"),  # objects and lists mixed: exactly 32
    (b'[{"a":' * 15 + b"[1, [[]]]" + b"}]" * 15, "json_too_deep"),
    (nested_objects(DEPTH, b'"\\u0000"'), "invalid_string"),
    (nested_objects(DEPTH + 1, b'{"b": "\\u0000"}'), "json_too_deep"),  # too deep is named first
    (b'["\\u0000", ' + nested(DEPTH) + b"]", "json_too_deep"),
    (b"[" + nested(DEPTH) + b', "\\u0000"]', "json_too_deep"),
    (b'["\\u0000", "' + b"[" * 40 + b'"]', "invalid_string"),  # brackets in a string
    (b'"' + b"[" * 40 + b'"', "ok"),
    (nested(900), "json_too_deep"),
    (nested(5_000), "json_too_deep"),
    (nested(100_000), "json_too_deep"),
    (nested_objects(100_000), "json_too_deep"),
    # the body's bytes
    (b'"\xff"', "invalid_json"),
    (b'"\xed\xa0\x80"', "invalid_json"),  # a surrogate encoded in the bytes: not UTF-8
    (b"\xef\xbb\xbf{}", "invalid_json"),  # a BOM
    (b"\xfe\xff\x00[\x00]", "invalid_json"),
    (b"", "invalid_json"),
    (b"[1] [2]", "invalid_json"),
]


@pytest.mark.parametrize(("raw", "code"), CORPUS, ids=[repr(r[:40]) for r, _ in CORPUS])
def test_given_a_tricky_body_expect_the_same_answer_as_the_walk_over_every_node(
    raw: bytes, code: str
) -> None:
    assert outcome(jsonbody.parse, raw) == outcome(walked, raw)
    assert outcome(jsonbody.parse, raw)[0] == code


def generated_bodies(count: int) -> Iterator[bytes]:
    """A string, as a key or a value, built from the pieces the text check reads: backslashes,
    escapes of NUL, of surrogate halves and of a backslash, and their text without the
    backslash, in any order."""
    pieces = [b"\\\\", b"\\u0000", b"\\ud83d", b"\\uDE00", b"\\udbff", b"\\udc00", b"\\u005c"]
    pieces += [b"u0000", b"ud800", b"uDE00", b"x", b"\\n", b"\\u00e9"]
    rng = random.Random(20_512)
    for n in range(count):
        text = b"".join(rng.choices(pieces, k=rng.randint(1, 5)))
        yield b'{"' + text + b'": 1}' if n % 2 else b'["a", "' + text + b'"]'


def test_given_generated_escapes_expect_the_same_answer_as_the_walk_over_every_node() -> None:
    answers = [
        (outcome(jsonbody.parse, raw), outcome(walked, raw)) for raw in generated_bodies(20_000)
    ]
    assert [fast for fast, _ in answers] == [exact for _, exact in answers]
    refused = sum(fast[0] == "invalid_string" for fast, _ in answers)
    assert 0 < refused < len(answers)  # both answers were met


@pytest.mark.parametrize("limit", [0, 640, 5000])
def test_given_another_int_digit_limit_expect_integers_past_either_refused_never_a_500(
    limit: int,
) -> None:
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(limit)
    try:
        assert outcome(jsonbody.parse, b"[" + b"7" * 4301 + b"]")[0] == "number_out_of_range"
        assert outcome(jsonbody.parse, b"[" + b"7" * 600 + b"]")[0] == "ok"
        past_python = outcome(jsonbody.parse, b"[" + b"7" * 1000 + b"]")[0]
        assert past_python == ("number_out_of_range" if 0 < limit < 1000 else "ok")
    finally:
        sys.set_int_max_str_digits(before)


# --- what the fast path does not call ------------------------------------------------------


def megabyte_of_small_values() -> bytes:
    """A 1 MiB envelope of small strings, integers and objects, with the escapes that only
    look suspicious: a pair, an escaped backslash before u0000."""
    items: list[Any] = []
    for n in range(40_000):
        items += [n, f"s{n}", {"id": n, "tag": "t"}]
    items += ["\U0001f600", "\\u0000", "\\ud800"]
    raw = json.dumps({"capability": "echo", "payload": items}).encode()
    assert 1 << 20 <= len(raw) < 2 << 20
    return raw


@pytest.fixture
def string_checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every string ``jsonbody`` checks one by one (and every integer it parses in Python)."""
    checked: list[str] = []
    check_string, parse_int = jsonbody._check_string, jsonbody._parse_int

    def counted_check(s: str) -> None:
        checked.append(s)
        check_string(s)

    def counted_int(text: str) -> int:
        checked.append(text)
        return parse_int(text)

    monkeypatch.setattr(jsonbody, "_check_string", counted_check)
    monkeypatch.setattr(jsonbody, "_parse_int", counted_int)
    return checked


def test_given_a_megabyte_of_small_values_expect_no_string_or_integer_checked_in_python(
    string_checks: list[str],
) -> None:
    raw = megabyte_of_small_values()
    assert jsonbody.parse(raw, max_depth=DEPTH) == json.loads(raw)
    assert string_checks == []


@pytest.mark.parametrize(
    ("bad", "message"),
    [(b"\\udfff", "lone surrogates"), (b"\\u0000", "NUL"), (b"\\\\\\u0000", "NUL")],
)
def test_given_a_bad_string_in_a_megabyte_expect_it_refused_with_no_string_checked_in_python(
    string_checks: list[str], bad: bytes, message: str
) -> None:
    """A refused body costs what an accepted one does: a tenant's bad bodies buy no walk."""
    raw = megabyte_of_small_values().replace(b'"s7"', b'"' + bad + b'"')
    code, said = outcome(jsonbody.parse, raw)
    assert (code, message in said) == ("invalid_string", True)
    assert string_checks == []


# --- what a value no body brought is written as (``written``) ------------------------------


@pytest.mark.parametrize(
    ("value", "code"),
    [
        ({"a": ["b", 1, 2.5, None, True]}, "ok"),
        ("a\\u0000", "ok"),  # a backslash, then the text u0000
        ("\\\x00", "invalid_string"),  # a backslash, then a NUL
        ("a\x00", "invalid_string"),
        ({"k\x00": 1}, "invalid_string"),
        (("in a tuple\x00",), "invalid_string"),  # the walk went into dicts and lists only
        ("\ud800", "invalid_string"),
        (nested_value := [[[[1]]]], "ok"),
        ([nested_value], "ok"),
        ([[nested_value]], "json_too_deep"),
        ([(((((1,),),),),)], "json_too_deep"),  # tuples are written as arrays
        ([["[" * 10]], "ok"),  # brackets in a string are no nesting
    ],
)
def test_given_a_value_expect_it_written_or_refused_as_a_body_would_be(
    value: Any, code: str
) -> None:
    try:
        data = jsonbody.written(value, max_depth=5)
    except BadRequest as exc:
        assert exc.code == code
    else:
        assert code == "ok"
        assert data == jsonbody.canonical(value)


def test_given_a_value_that_is_no_json_expect_a_type_or_value_error() -> None:
    for value in (math.nan, {1, 2}, object()):
        with pytest.raises((TypeError, ValueError)) as raised:
            jsonbody.written(value, max_depth=5)
        assert not isinstance(raised.value, BadRequest)


def test_given_a_value_nested_past_the_interpreter_expect_too_deep_not_a_recursion_error() -> None:
    value: Any = []
    for _ in range(sys.getrecursionlimit() * 2):
        value = [value]
    with pytest.raises(BadRequest) as raised:
        jsonbody.written(value, max_depth=sys.getrecursionlimit())
    assert raised.value.code == "json_too_deep"


def test_given_a_megabyte_result_expect_no_node_walked_in_python(
    string_checks: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent's result of up to ``REACH_MAX_RESULT_BYTES`` was walked node by node on the
    worker's loop (the bridge's, that every tenant's calls share) before it was written."""
    walks: list[Any] = []
    monkeypatch.setattr(jsonbody, "check_tree", lambda value, **_: walks.append(value))
    value = json.loads(megabyte_of_small_values())
    assert jsonbody.written(value, max_depth=DEPTH) == jsonbody.canonical(value)
    assert (walks, string_checks) == ([], [])
