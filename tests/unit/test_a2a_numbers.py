"""The numbers of a task's JSON in A2A's protobuf messages, whose numbers are doubles."""

from __future__ import annotations

import json
from typing import Any

from broker.facades import a2a
from tests.unit.test_a2a_facade import task


def succeeded(result: Any, progress: Any = None) -> dict[str, Any]:
    return task("succeeded", result=result, progress=progress)


def test_an_integer_a_double_cannot_hold_exactly_goes_as_its_digits() -> None:
    # beyond a double's range (ParseDict raised OverflowError), past 2**53 with digits a
    # double would round, negative, and deep in lists and objects
    result = {"big": 10**400, "id": 2**53 + 1, "neg": -(10**30 + 7), "in": [[{"x": 10**309}]]}
    body = json.loads(a2a.push_body(succeeded(result, progress={"done": 10**400})))
    [part] = body["task"]["artifacts"][0]["parts"]
    assert part["data"] == {
        "big": str(10**400),
        "id": str(2**53 + 1),
        "neg": str(-(10**30 + 7)),
        "in": [[{"x": str(10**309)}]],
    }
    assert body["task"]["metadata"]["reach"]["progress"] == {"done": str(10**400)}


def test_numbers_a_double_holds_stay_numbers() -> None:
    result = {"n": 7, "max": 2**53, "round": 2**60, "f": 0.5, "yes": True, "none": None}
    [part] = json.loads(a2a.push_body(succeeded(result)))["task"]["artifacts"][0]["parts"]
    assert part["data"] == {
        "n": 7.0,
        "max": float(2**53),
        "round": float(2**60),
        "f": 0.5,
        "yes": True,
        "none": None,
    }
