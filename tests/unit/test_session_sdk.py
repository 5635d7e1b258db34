"""``ctx.session`` without a database: a writer that is a function, keeping one revision."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from workers.sdk.session import Session, SessionConflict


class Kept:
    """A session store of one session, as a compare-and-set on its revision."""

    def __init__(self, state: dict[str, Any], revision: int = 1) -> None:
        self.state, self.revision = state, revision
        self.writes = 0

    def write(self, revision: int, state: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if revision != self.revision:
            raise SessionConflict("stale", current_revision=self.revision)
        self.writes += 1
        self.revision, self.state = revision + 1, state
        return self.revision, self.state

    def read(self) -> tuple[int, dict[str, Any]]:
        return self.revision, self.state

    def session(self) -> Session:
        return Session("sess_x", self.revision, dict(self.state), self.write, self.read)


def test_given_a_current_read_when_updated_expect_the_next_revision_on_the_session() -> None:
    kept = Kept({"n": 1})
    session = kept.session()
    session.update({"n": 2})
    assert (session.revision, session.state) == (2, {"n": 2})
    assert (kept.revision, kept.state) == (2, {"n": 2})


def test_given_a_stale_read_when_updated_expect_session_conflict_and_nothing_written() -> None:
    kept = Kept({"n": 1})
    session = kept.session()
    kept.write(1, {"n": "someone else"})
    with pytest.raises(SessionConflict) as raised:
        session.update({"n": 2})
    assert raised.value.current_revision == 2
    assert raised.value.code == "session_conflict" and raised.value.retryable
    assert kept.state == {"n": "someone else"} and session.revision == 1


def test_given_a_stale_read_when_mutated_expect_the_change_applied_to_a_fresh_read() -> None:
    kept = Kept({"log": ["a"]})
    session = kept.session()
    kept.write(1, {"log": ["a", "b"]})
    written = session.mutate(lambda state: state["log"].append("c"))
    assert written == {"log": ["a", "b", "c"]}
    assert (kept.revision, session.revision) == (3, 3)


def test_given_a_change_that_returns_a_state_expect_that_state_written() -> None:
    kept = Kept({"n": 1})
    assert kept.session().mutate(lambda state: {"n": state["n"] + 1}) == {"n": 2}


def test_given_a_session_always_moving_expect_mutate_to_give_up_after_its_attempts() -> None:
    kept = Kept({"n": 0})
    session = kept.session()
    calls = []

    def change(state: dict[str, Any]) -> None:
        calls.append(state["n"])
        kept.write(kept.revision, {"n": kept.state["n"] + 1})  # someone else, every time

    with pytest.raises(SessionConflict):
        session.mutate(change, attempts=3)
    assert len(calls) == 3


def test_given_a_failed_write_expect_the_read_state_untouched_by_the_change() -> None:
    kept = Kept({"log": []})
    session = kept.session()
    kept.write(1, {"log": ["other"]})
    seen: list[list[str]] = []
    session.mutate(lambda state: seen.append(list(state["log"])) or state["log"].append("me"))
    assert seen == [[], ["other"]]
    assert kept.state == {"log": ["other", "me"]}


def test_given_a_state_that_is_not_an_object_expect_type_error() -> None:
    with pytest.raises(TypeError):
        Kept({}).session().update([1])  # type: ignore[arg-type]


def test_the_async_twins_write_as_the_sync_ones_do() -> None:
    kept = Kept({"log": []})
    session = kept.session()

    async def handler() -> None:
        await session.update_async({"log": ["a"]})
        kept.write(2, {"log": ["a", "b"]})
        await session.mutate_async(lambda state: state["log"].append("c"))

    asyncio.run(handler())
    assert kept.state == {"log": ["a", "b", "c"]} and session.revision == 4


def test_given_a_state_of_json_values_expect_the_change_applied_to_an_exact_copy() -> None:
    """The draft is a copy through JSON (C, not ``copy.deepcopy``'s Python walk): every value
    the state may hold comes back exactly, and the change touches the copy alone."""
    state = {"n": 2**70, "f": 0.1, "s": "é\u2028", "l": [[], {}, None, True], "d": {"k": [1]}}
    store = Kept(state)
    session = store.session()

    def change(draft: dict[str, Any]) -> None:
        assert draft == state
        draft["d"]["k"].append(2)

    written = session.mutate(change)
    assert written["d"] == {"k": [1, 2]} and state["d"] == {"k": [1]}
    assert {k: v for k, v in written.items() if k != "d"} == {
        k: v for k, v in state.items() if k != "d"
    }
