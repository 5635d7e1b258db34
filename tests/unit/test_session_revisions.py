"""The revision an ``If-Match`` names (``broker.sessions.revision_of``)."""

from __future__ import annotations

import pytest

from broker.sessions import PreconditionRequired, revision_of


@pytest.mark.parametrize(("if_match", "revision"), [('"7"', 7), ('W/"7"', 7), (' "12" ', 12)])
def test_a_tag_names_its_revision(if_match: str, revision: int) -> None:
    assert revision_of(if_match) == revision


@pytest.mark.parametrize(
    "if_match",
    # Python's int read the first three as 10, 3 and 3; a write names the one revision it read
    ['"1_0"', '"\u0663"', '"+3"', '" 3 "', "7", '"7', "*", '"1", "2"', '"' + "9" * 19 + '"'],
)
def test_anything_else_names_no_revision(if_match: str) -> None:
    assert revision_of(if_match) == -1


@pytest.mark.parametrize("if_match", [None, "", "  "])
def test_none_is_a_precondition_required(if_match: str | None) -> None:
    with pytest.raises(PreconditionRequired):
        revision_of(if_match)
