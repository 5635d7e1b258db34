"""Unit tests for strict request-body JSON: what is refused, with which code, and digests."""

import hashlib
from collections.abc import Callable

import pytest

from broker import jsonbody
from broker.errors import BadRequest

DEPTH = 32
Build = Callable[[int], bytes]


def nested_lists(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def nested_objects(depth: int) -> bytes:
    return b'{"a":' * (depth - 1) + b"{}" + b"}" * (depth - 1)


def rejected_code(raw: bytes, *, max_depth: int = DEPTH) -> str:
    with pytest.raises(BadRequest) as caught:
        jsonbody.parse(raw, max_depth=max_depth)
    return caught.value.code


# --- what is accepted ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        (b'{"a": [1, 2.5, true, null, "x"]}', {"a": [1, 2.5, True, None, "x"]}),
        (b"[]", []),
        (b'"plain"', "plain"),
        (b"0", 0),
        (b"-7", -7),
        (b"1e308", 1e308),
        (b"123456789012345678901", 123456789012345678901),
        (b"-" + b"9" * 4300, -int("9" * 4300)),
        ('{"name": "Zoë 你好"}'.encode(), {"name": "Zoë 你好"}),
        (b'"\\ud83d\\ude00"', "\U0001f600"),  # an escaped surrogate *pair* is one code point
    ],
)
def test_given_ordinary_json_expect_the_parsed_value(raw: bytes, value: object) -> None:
    assert jsonbody.parse(raw, max_depth=DEPTH) == value


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        (b"99999999999999999999", 99999999999999999999),
        (b"-99999999999999999999", -99999999999999999999),
        (b"12345678901234567890", 12345678901234567890),
        (b'{"n": -1}', {"n": -1}),
    ],
)
def test_given_integers_up_to_twenty_digits_expect_them_accepted(raw: bytes, value: int) -> None:
    assert jsonbody.parse(raw, max_depth=DEPTH) == value


# --- what is refused, and with which code --------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [b"", b"   ", b"{", b"[1,]", b"{'a': 1}", b'{"a" 1}', b"undefined", b"[1] [2]", b'"a\x00b"'],
)
def test_given_invalid_json_expect_invalid_json(raw: bytes) -> None:
    assert rejected_code(raw) == "invalid_json"


@pytest.mark.parametrize("raw", [b'"\xff"', b'{"a": "caf\xe9"}', b"\xfe\xff\x00[\x00]", b"\x80"])
def test_given_a_body_that_is_not_utf8_expect_invalid_json(raw: bytes) -> None:
    assert rejected_code(raw) == "invalid_json"


@pytest.mark.parametrize(
    "raw",
    [b"NaN", b"Infinity", b"-Infinity", b'{"x": NaN}', b"[1, Infinity]", b'{"x": -Infinity}'],
)
def test_given_nan_or_infinity_expect_number_out_of_range(raw: bytes) -> None:
    assert rejected_code(raw) == "number_out_of_range"


@pytest.mark.parametrize("raw", [b"1e999", b"-1e999", b'{"x": 1e400}', b"[1.5e999]"])
def test_given_a_float_that_overflows_expect_number_out_of_range(raw: bytes) -> None:
    assert rejected_code(raw) == "number_out_of_range"


@pytest.mark.parametrize(
    "raw",
    [
        b"1" + b"0" * 4300,
        b"-" + b"9" * 4301,
        b'{"n": ' + b"1" * 4301 + b"}",
        b"1" + b"0" * 5000,  # beyond Python's int-parsing limit: must still be a clean 400
    ],
)
def test_given_an_integer_over_4300_digits_expect_number_out_of_range(raw: bytes) -> None:
    assert rejected_code(raw) == "number_out_of_range"


@pytest.mark.parametrize(
    "raw",
    [
        b'"a\\u0000b"',
        b'{"a": "\\u0000"}',
        b'[["x", "\\u0000"]]',
        b'{"\\u0000": 1}',
        b'{"k\\u0000": 1}',
    ],
)
def test_given_nul_in_a_value_or_key_expect_invalid_string(raw: bytes) -> None:
    assert rejected_code(raw) == "invalid_string"


@pytest.mark.parametrize(
    "raw",
    [b'"\\ud800"', b'"\\udc00"', b'{"a": "x\\ud83dy"}', b'{"\\ud800": 1}', b'["ok", "\\udfff"]'],
)
def test_given_a_lone_surrogate_expect_invalid_string(raw: bytes) -> None:
    assert rejected_code(raw) == "invalid_string"


# --- nesting depth -------------------------------------------------------------------------


@pytest.mark.parametrize("build", [nested_lists, nested_objects])
def test_given_nesting_of_exactly_max_depth_expect_accepted(build: Build) -> None:
    assert jsonbody.parse(build(DEPTH), max_depth=DEPTH) is not None


@pytest.mark.parametrize("build", [nested_lists, nested_objects])
def test_given_nesting_one_over_max_depth_expect_json_too_deep(build: Build) -> None:
    assert rejected_code(build(DEPTH + 1)) == "json_too_deep"


def test_given_scalars_at_the_deepest_level_expect_them_not_counted_as_a_level() -> None:
    assert jsonbody.parse(b'[1, "x", null]', max_depth=1) == [1, "x", None]
    assert jsonbody.parse(b'{"a": 1}', max_depth=1) == {"a": 1}
    assert rejected_code(b"[[]]", max_depth=1) == "json_too_deep"


@pytest.mark.parametrize("depth", [900, 5_000, 100_000])
@pytest.mark.parametrize("build", [nested_lists, nested_objects])
def test_given_very_deep_nesting_expect_json_too_deep_not_recursion_error(
    build: Build, depth: int
) -> None:
    assert rejected_code(build(depth)) == "json_too_deep"


# --- canonical and digest ------------------------------------------------------------------


def test_given_the_same_object_with_keys_in_another_order_expect_the_same_canonical_bytes() -> None:
    one = {"b": 1, "a": {"y": [1, 2], "x": None}}
    two = {"a": {"x": None, "y": [1, 2]}, "b": 1}
    assert jsonbody.canonical(one) == jsonbody.canonical(two) == b'{"a":{"x":null,"y":[1,2]},"b":1}'
    assert jsonbody.digest(one) == jsonbody.digest(two)


def test_given_different_values_expect_different_digests() -> None:
    assert jsonbody.digest({"a": 1})[0] != jsonbody.digest({"a": 2})[0]
    assert jsonbody.digest([1, 2])[0] != jsonbody.digest([2, 1])[0]


def test_given_a_value_expect_digest_is_sha256_of_the_canonical_bytes() -> None:
    value = {"order": 7731, "items": ["a", "b"]}
    hexdigest, size = jsonbody.digest(value)
    data = jsonbody.canonical(value)
    assert hexdigest == hashlib.sha256(data).hexdigest()
    assert size == len(data)


def test_given_non_ascii_text_expect_size_counted_in_utf8_bytes_not_characters() -> None:
    value = {"k": "é你"}
    canonical = jsonbody.canonical(value)
    assert canonical == '{"k":"é你"}'.encode()  # written as UTF-8, not \u escapes
    _, size = jsonbody.digest(value)
    assert size == len('{"k":"é你"}'.encode()) == 13
    assert size > len('{"k":"é你"}')


# --- sent_size: a number as Postgres gives it back -----------------------------------------

# Each value, and its bytes once jsonb has kept it and the API sends it back: numeric's text
# has no exponent (Postgres's own, as psql shows it).
KEPT_AS_NUMERIC = [
    (1e308, 309),  # "1000...0": 309 digits, read back as an integer and sent whole
    (-1e308, 310),
    (-1.5e-300, 304 + 1),  # "-0.000...15", and a byte for the fraction (an upper bound)
    (1e-05, 7),  # "0.00001"
    (1e16, 17),
    ([1e300, 1e300], 2 + 301 + 1 + 301),
    ({"n": [1e22]}, len('{"n":[]}') + 23),
]


@pytest.mark.parametrize(("value", "size"), KEPT_AS_NUMERIC)
def test_given_numbers_in_exponent_form_expect_them_counted_as_numeric_text(
    value: object, size: int
) -> None:
    assert jsonbody.sent_size(jsonbody.canonical(value)) == size
    assert jsonbody.digest(value)[1] == size


def test_given_a_mantissa_with_a_fraction_expect_at_most_17_bytes_over() -> None:
    biggest = 1.7976931348623157e308  # "17976931348623157" and 292 zeros
    assert 309 <= jsonbody.sent_size(jsonbody.canonical(biggest)) <= 309 + 17


@pytest.mark.parametrize(
    "value",
    [
        {"order": 7731, "price": 12.5, "ratio": 0.0001, "big": 123456789012345678901},
        [0, -7, 1e15, 3.14159, 2.5e-4],  # json.dumps writes these without an exponent
        {"text": "1E+20, 1e+20 and 3e-300 inside strings"},
        {"v": "1E+20"},
        "é你 1e+308",
    ],
)
def test_given_no_number_in_exponent_form_expect_the_canonical_size(value: object) -> None:
    data = jsonbody.canonical(value)
    assert jsonbody.sent_size(data) == len(data)


def test_given_exponent_text_inside_a_string_expect_at_most_an_overcount() -> None:
    # A string that looks like numbers between commas may be counted as them: too high,
    # never too low.
    data = jsonbody.canonical({"s": "a,1e+308,b"})
    assert jsonbody.sent_size(data) >= len(data)


def test_given_nested_values_expect_each_member_counted_and_no_further_than_past_the_limit() -> (
    None
):
    value = {"a": [1, 2, {"b": 3}], "c": "x"}
    assert jsonbody.values_in(value, 100) == 6
    assert jsonbody.values_in(value, 1) == 2  # stopped once past it
    assert jsonbody.more_values_than(value, 5) and not jsonbody.more_values_than(value, 6)
    assert jsonbody.values_in("text", 0) == 0
