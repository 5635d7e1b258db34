"""The JSON Schemas a card declares (``input_schema``, ``output_schema``): checked when the card
is declared, and the payloads checked against them, in the API and in the worker.

- **Nothing is fetched.** A ``$ref`` resolves inside the schema, or to a JSON Schema
  meta-schema jsonschema ships; any other is refused when the card is declared. Left to
  itself, jsonschema fetches a remote ``$ref`` with ``urllib``, synchronously and with no
  timeout: in the API, on its event loop, from a URL a registration named, past the network
  guards (a tarpit there held every request of the process for as long as it held the fetch).
- **Every reference resolves when the card is declared.** A ``$ref`` to nowhere was accepted,
  and then every payload's validation raised (a 500 on each submit).
- **A check that cannot be computed is a refusal.** ``multipleOf: 0.5`` against an integer of
  400 digits raises ``OverflowError`` in jsonschema: that payload is refused (422), not a 500.
- **A payload costs the checker about its size.** The check runs on an event loop every
  tenant's requests share (the API's; the worker's for async handlers and the bridge), so a
  payload must not choose its cost. jsonschema compares every pair of an array's items for
  ``uniqueItems`` when they do not sort (objects): 4,000 distinct objects, 51 KB of JSON,
  held the loop 16.5 s, 8,000 held it 65 s. Here each item is keyed once, by its JSON value.
  And a payload's errors are taken only as far as ``PROBLEMS_MAX``: 500,000 items of the wrong
  type, 1 MB of JSON, built half a million errors to show 20 (13.7 s and 1.7 GiB at the peak).
  That cap held only at the top: jsonschema's ``anyOf`` and ``oneOf`` list every error of
  every branch before deciding, so a payload *valid* under ``list[int] | list[str]`` (330,000
  strings) cost 8.3 s and 0.9 GiB, and ``Optional[list[Optional[int]]]`` 25 s and 2.9 GiB.
  Here a branch is decided by its first error, and a refusal names that one per branch.
  ``unevaluatedItems`` and ``unevaluatedProperties`` looked each index or key up in a list of
  the evaluated ones: 20,000 items, 40 KB, cost 1.5 s; here a set.
"""

from __future__ import annotations

import itertools
import reprlib
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import urljoin

from jsonschema import Draft202012Validator, _utils, validators
from jsonschema.exceptions import SchemaError, ValidationError
from jsonschema_specifications import REGISTRY as META_SCHEMAS  # type: ignore[import-untyped]
from referencing import Registry, Resource
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT202012

REFERENCES = ("$ref", "$dynamicRef")
PROBLEMS_MAX = 20  # the errors a refusal reports, and all that are looked for
EXTRAS_SHOWN = 5  # of the items or properties a schema did not expect, those a message names


class PayloadUncheckable(Exception):
    """The payload could not be checked against the schema (a number past what it computes)."""


def allows_objects(schema: Any) -> bool:
    """Whether ``schema``'s own ``type`` (none: any) lets a JSON object through."""
    kinds = schema.get("type", "object") if isinstance(schema, dict) else "object"
    return "object" in (kinds if isinstance(kinds, list) else [kinds])


def check(schema: Any) -> None:
    """SchemaError unless ``schema`` is a valid 2020-12 schema whose every reference resolves
    without fetching anything."""
    Draft202012Validator.check_schema(schema)
    registry, root = _registry(schema)
    for base, reference in _references(schema, root):
        try:
            registry.resolver(base_uri=base).lookup(reference)
        except Unresolvable as exc:
            raise SchemaError(f"{reference!r} does not resolve within the schema ({exc})") from None


def _unique_items(
    checker: Any, unique: Any, instance: Any, schema: Any
) -> Iterator[ValidationError]:
    """``uniqueItems`` in one pass: each item keyed by its JSON value (``json_value``)."""
    if not unique or not checker.is_type(instance, "array"):
        return
    seen: set[Any] = set()
    for item in instance:
        key = json_value(item)
        if key in seen:
            yield ValidationError("has non-unique elements")
            return
        seen.add(key)


def json_value(item: Any) -> Any:
    """A hashable key equal for two JSON values exactly when JSON Schema counts them equal:
    ``1`` and ``1.0`` are, ``true`` and ``1`` are not, an object's key order does not count."""
    if isinstance(item, bool) or item is None:
        return ("literal", item)
    if isinstance(item, int | float):
        return ("number", item)  # 1 == 1.0, and they hash alike
    if isinstance(item, str):
        return ("string", item)
    if isinstance(item, list):
        return ("array", tuple(json_value(each) for each in item))
    if isinstance(item, dict):
        return ("object", frozenset((key, json_value(each)) for key, each in item.items()))
    return ("other", repr(item))


def _any_of(
    checker: Any, branches: Sequence[Any], instance: Any, schema: Any
) -> Iterator[ValidationError]:
    """``anyOf``, each branch decided by its first error, not by all of them."""
    firsts = []
    for index, branch in enumerate(branches):
        first = _first_error(checker, instance, branch, index)
        if first is None:
            return
        firsts.append(first)
    yield ValidationError(
        f"{reprlib.repr(instance)} is not valid under any of the given schemas", context=firsts
    )


def _one_of(
    checker: Any, branches: Sequence[Any], instance: Any, schema: Any
) -> Iterator[ValidationError]:
    """``oneOf`` as ``anyOf`` does it; decided at the second branch that holds."""
    firsts, valid = [], []
    for index, branch in enumerate(branches):
        first = _first_error(checker, instance, branch, index)
        if first is not None:
            firsts.append(first)
            continue
        valid.append(branch)
        if len(valid) == 2:
            shown = ", ".join(reprlib.repr(each) for each in valid)
            yield ValidationError(f"{reprlib.repr(instance)} is valid under each of {shown}")
            return
    if not valid:
        yield ValidationError(
            f"{reprlib.repr(instance)} is not valid under any of the given schemas",
            context=firsts,
        )


def _first_error(checker: Any, instance: Any, branch: Any, index: int) -> ValidationError | None:
    error: ValidationError | None = next(checker.descend(instance, branch, schema_path=index), None)
    return error


def _unevaluated_items(
    checker: Any, unevaluated: Any, instance: Any, schema: Any
) -> Iterator[ValidationError]:
    if not checker.is_type(instance, "array"):
        return
    # jsonschema's own search (a private helper: the tests reach it there), into a set
    evaluated = set(_utils.find_evaluated_item_indexes_by_schema(checker, instance, schema))
    unexpected = [item for index, item in enumerate(instance) if index not in evaluated]
    if unexpected:
        yield ValidationError(
            f"Unevaluated items are not allowed ({_extras(unexpected, 'unexpected')})"
        )


def _unevaluated_properties(
    checker: Any, unevaluated: Any, instance: Any, schema: Any
) -> Iterator[ValidationError]:
    """Also one error taken per property, not all of them (and the property named once)."""
    if not checker.is_type(instance, "object"):
        return
    evaluated = set(_utils.find_evaluated_property_keys_by_schema(checker, instance, schema))
    refused = [
        key
        for key, value in instance.items()
        if key not in evaluated
        and next(checker.descend(value, unevaluated, path=key, schema_path=key), None) is not None
    ]
    if refused and unevaluated is False:
        extras = _extras(sorted(refused, key=str), "unexpected")
        yield ValidationError(f"Unevaluated properties are not allowed ({extras})")
    elif refused:
        extras = _extras(refused, "unevaluated and invalid")
        yield ValidationError(
            f"Unevaluated properties are not valid under the given schema ({extras})"
        )


def _extras(values: list[Any], what: str) -> str:
    """jsonschema's list of extra items or properties, its first few of them."""
    shown = ", ".join(reprlib.repr(each) for each in values[:EXTRAS_SHOWN])
    more = f" and {len(values) - EXTRAS_SHOWN} more" if len(values) > EXTRAS_SHOWN else ""
    return f"{shown}{more} {'was' if len(values) == 1 else 'were'} {what}"


_Checker = validators.extend(  # type: ignore[no-untyped-call]
    Draft202012Validator,
    {
        "uniqueItems": _unique_items,
        "anyOf": _any_of,
        "oneOf": _one_of,
        "unevaluatedItems": _unevaluated_items,
        "unevaluatedProperties": _unevaluated_properties,
    },
)


def validator(schema: Any) -> Draft202012Validator:
    """A validator that never fetches a reference."""
    registry, _ = _registry(schema)
    checker: Draft202012Validator = _Checker(schema, registry=registry)
    return checker


def problems(checker: Draft202012Validator, payload: Any) -> list[ValidationError]:
    """What is wrong with ``payload`` (the first ``PROBLEMS_MAX`` errors found), by path;
    PayloadUncheckable when it cannot be computed."""
    try:
        found = list(itertools.islice(checker.iter_errors(payload), PROBLEMS_MAX))
    except (OverflowError, RecursionError, Unresolvable) as exc:
        raise PayloadUncheckable(f"{type(exc).__name__}: {exc}") from None
    return sorted(found, key=lambda e: list(e.absolute_path))


def _registry(schema: Any) -> tuple[Registry[Any], str]:
    """The schema's own resources (its nested ``$id`` too) and the meta-schemas, with nothing
    to retrieve from elsewhere; and the schema's base URI."""
    resource: Resource[Any] = DRAFT202012.create_resource(schema)
    root = resource.id() or ""
    return META_SCHEMAS.with_resource(root, resource).crawl(), root


def _references(node: Any, base: str) -> Iterator[tuple[str, str]]:
    """(base URI, reference) of each ``$ref`` and ``$dynamicRef`` in the schema."""
    if isinstance(node, dict):
        if isinstance(node.get("$id"), str):
            base = urljoin(base, node["$id"])
        for key, value in node.items():
            if key in REFERENCES and isinstance(value, str):
                yield base, value
            elif key not in ("const", "enum", "default", "examples"):
                yield from _references(value, base)
    elif isinstance(node, list):
        for item in node:
            yield from _references(item, base)
