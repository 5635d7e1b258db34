"""The numbers of a task's JSON in A2A's protobuf messages, whose numbers are doubles."""

from __future__ import annotations

import json
from typing import Any

from broker.facades import a2a
from broker.remote.a2a_json import whole_in_place
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


def test_a_data_part_of_our_own_parse_has_its_whole_floats_as_integers_and_keeps_the_rest() -> None:
    # A client on protobuf sends 3 as 3.0: the lifted part reads as the SDK's path read it,
    # while an integer sent as digits stays exact, and a float that is not whole stays one
    sent = {"n": 3.0, "id": 2**60 + 1, "x": 0.5, "deep": [[{"k": -2.0}], 1e300], "s": "3.0"}
    assert whole_in_place(sent) == {
        "n": 3,
        "id": 2**60 + 1,
        "x": 0.5,
        "deep": [[{"k": -2}], 1e300],
        "s": "3.0",
    }
    assert type(sent["n"]) is int and type(sent["deep"][0][0]["k"]) is int  # in place
    assert whole_in_place(7.0) == 7 and type(whole_in_place(7.0)) is int
