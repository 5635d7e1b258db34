"""The revision an ``If-Match`` names (``broker.sessions.revision_of``)."""

from __future__ import annotations

import pytest

from broker.sessions import ANY_REVISION, PreconditionRequired, revision_of


@pytest.mark.parametrize(("if_match", "revision"), [('"7"', 7), ('W/"7"', 7), (' "12" ', 12)])
def test_a_tag_names_its_revision(if_match: str, revision: int) -> None:
    assert revision_of(if_match) == {revision}


@pytest.mark.parametrize(("if_match", "revision"), [("7", 7), (" 12 ", 12)])
def test_a_bare_revision_as_the_contracts_table_writes_it_names_it(
    if_match: str, revision: int
) -> None:
    assert revision_of(if_match) == {revision}


@pytest.mark.parametrize(
    ("if_match", "revisions"),
    [('"1", "2"', {1, 2}), ('"3",W/"4" ,, "x"', {3, 4}), (', "5",', {5}), ('"a,b", "6"', {6})],
)
def test_a_list_names_each_of_its_tags_revisions(if_match: str, revisions: set[int]) -> None:
    """RFC 9110's list: empty members allowed; a tag not of ours, a comma in it or not,
    names nothing."""
    assert revision_of(if_match) == revisions


@pytest.mark.parametrize("if_match", ["*", " * "])
def test_a_star_names_any_revision(if_match: str) -> None:
    assert revision_of(if_match) is ANY_REVISION


@pytest.mark.parametrize(
    "if_match",
    # Python's int read the first three as 10, 3 and 3; a write names the one revision it read
    [
        *['"1_0"', '"\u0663"', '"+3"', '" 3 "', "1_0", "\u0663", "+3", "7 8", '"7', '"1" "2"'],
        *['*, "1"', '"' + "9" * 19 + '"'],
    ],
)
def test_anything_else_names_no_revision(if_match: str) -> None:
    assert revision_of(if_match) == frozenset()


@pytest.mark.parametrize("if_match", [None, "", "  "])
def test_none_is_a_precondition_required(if_match: str | None) -> None:
    with pytest.raises(PreconditionRequired):
        revision_of(if_match)
