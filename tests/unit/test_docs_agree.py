"""The README says what the code does: its error table.

Read as text, against the code's own table: ``api.errors.STATUS_BY_CODE``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from api.errors import STATUS_BY_CODE

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
ERROR_TABLE_HEADER = "| status | codes |"


def error_table(text: str) -> dict[int, set[str]]:
    """Each status of the README's error table and the codes its row names."""
    lines = text.splitlines()
    start = lines.index(ERROR_TABLE_HEADER) + 2  # past the header and its rule
    rows: dict[int, set[str]] = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        status, codes = line.strip("|").split("|", 1)
        rows[int(status)] = set(re.findall(r"`([a-z][a-z0-9_]*)`", codes))
    return rows


# --- the helpers ---------------------------------------------------------------------------


def test_error_table_reader_reads_each_row_and_stops_at_the_table_end() -> None:
    # given a table between prose, a code with a note in parentheses
    text = (
        "intro\n| status | codes |\n| --- | --- |\n"
        "| 404 | `a_b`, `c` (`REACH_X`) |\n| 409 | `d` |\n\nafter `e`\n"
    )
    # when / expect each row's codes, and nothing past the table
    assert error_table(text) == {404: {"a_b", "c"}, 409: {"d"}}


# --- the README against the code -------------------------------------------------------------


@pytest.mark.parametrize(("code", "status"), sorted(STATUS_BY_CODE.items()))
def test_every_code_of_the_status_table_is_in_the_readme_row_of_its_status(
    code: str, status: int
) -> None:
    rows = error_table(README.read_text(encoding="utf-8"))
    assert code in rows.get(status, set()), f"README's error table: {status} lacks `{code}`"
