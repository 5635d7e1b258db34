"""``reach --help`` names every exit status ``reach_client.cli.exits`` defines, and no other."""

from __future__ import annotations

import re

from reach_client.cli import EPILOG, exits


def defined_statuses() -> set[int]:
    return {
        value
        for name, value in vars(exits).items()
        if name.isupper() and isinstance(value, int) and not isinstance(value, bool)
    }


def epilog_statuses(epilog: str) -> set[int]:
    """The numbers the epilog's ``exit status:`` part gives a meaning to."""
    _, listed = epilog.split("exit status:", 1)
    return {int(n) for n in re.findall(r"(?:^|[\s,])(\d+) [a-z-]", listed)}


def test_epilog_reader_finds_each_listed_status() -> None:
    # given an epilog with a configuration part and a status list over two lines
    text = "configuration: 2 files\n\nexit status: 0 done, 5 --timeout ran out,\n130 interrupted."
    # when / expect only the statuses of the list
    assert epilog_statuses(text) == {0, 5, 130}


def test_every_exit_status_defined_is_in_the_help_epilog() -> None:
    assert epilog_statuses(EPILOG) == defined_statuses()
