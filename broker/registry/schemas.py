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
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import urljoin

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, ValidationError
from jsonschema_specifications import REGISTRY as META_SCHEMAS  # type: ignore[import-untyped]
from referencing import Registry, Resource
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT202012

REFERENCES = ("$ref", "$dynamicRef")


class PayloadUncheckable(Exception):
    """The payload could not be checked against the schema (a number past what it computes)."""


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


def validator(schema: Any) -> Draft202012Validator:
    """A validator that never fetches a reference."""
    registry, _ = _registry(schema)
    return Draft202012Validator(schema, registry=registry)


def problems(checker: Draft202012Validator, payload: Any) -> list[ValidationError]:
    """What is wrong with ``payload``, by path; PayloadUncheckable when it cannot be computed."""
    try:
        return sorted(checker.iter_errors(payload), key=lambda e: list(e.absolute_path))
    except (OverflowError, RecursionError, Unresolvable) as exc:
        raise PayloadUncheckable(f"{type(exc).__name__}: {exc}") from None


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
