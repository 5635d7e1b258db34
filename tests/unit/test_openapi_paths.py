"""Every ``{name}`` of a path in ``/openapi.json`` is a declared path parameter: a client
generator (openapi-python-client) skips an operation whose template has none, as it did
a2a-sdk's REST routes (``/a2a/rest/tasks/{id}``), which declare none."""

from __future__ import annotations

import re
from typing import Any

import pytest

from api.app import create_app
from api.contract import finish
from broker.settings import Settings

TEMPLATE = re.compile(r"\{([^{}]+)\}")


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    return create_app(Settings()).openapi()


def undeclared(doc: dict[str, Any]) -> list[str]:
    """``METHOD path {name}`` for each template name its operation does not declare."""
    missing = []
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            declared = {p["name"] for p in operation.get("parameters", []) if p["in"] == "path"}
            missing += [
                f"{method} {path} {{{n}}}" for n in TEMPLATE.findall(path) if n not in declared
            ]
    return missing


def test_every_path_template_names_a_declared_path_parameter(document: dict[str, Any]) -> None:
    assert any(path.startswith("/a2a/rest/tasks/{id}") for path in document["paths"])
    assert undeclared(document) == []


def test_a_declared_path_parameter_is_kept_as_it_is() -> None:
    # Given an operation of ours that declares its parameter with its own rule
    ours = {"name": "task_id", "in": "path", "required": True, "schema": {"pattern": "^x$"}}
    doc = {"paths": {"/tasks/{task_id}/x/{other}": {"get": {"parameters": [dict(ours)]}}}}
    # When the document is finished
    finish(doc)
    # Then its own stays whole and only the undeclared one is added, as a required string
    parameters = doc["paths"]["/tasks/{task_id}/x/{other}"]["get"]["parameters"]
    assert parameters[0] == ours
    assert parameters[1]["name"] == "other" and parameters[1]["required"] is True
    assert undeclared(doc) == []
