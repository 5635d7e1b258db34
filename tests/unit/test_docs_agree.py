"""The README says what the code does: its error table, the settings it lists, and the tests
the docs name as holding a guarantee.

Read as text, against the code's own tables: ``api.errors.STATUS_BY_CODE``, the fields of
``broker.settings.Settings``, and the test functions under ``tests/``.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest
from pydantic import AliasChoices

from api.errors import STATUS_BY_CODE
from broker.settings import Settings

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


def docs() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def documented_settings_text() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in docs())


def env_names(field_name: str) -> list[str]:
    """The environment variables a Settings field is read from."""
    alias = Settings.model_fields[field_name].validation_alias
    if isinstance(alias, AliasChoices):
        return [str(choice) for choice in alias.choices]
    return [f"REACH_{field_name.upper()}"]


# --- the helpers ---------------------------------------------------------------------------


def test_error_table_reader_reads_each_row_and_stops_at_the_table_end() -> None:
    # given a table between prose, a code with a note in parentheses
    text = (
        "intro\n| status | codes |\n| --- | --- |\n"
        "| 404 | `a_b`, `c` (`REACH_X`) |\n| 409 | `d` |\n\nafter `e`\n"
    )
    # when / expect each row's codes, and nothing past the table
    assert error_table(text) == {404: {"a_b", "c"}, 409: {"d"}}


def test_env_names_of_a_field_with_aliases_are_the_aliases() -> None:
    assert env_names("database_url") == ["REACH_DATABASE_URL", "DATABASE_URL"]
    assert env_names("sync_max_wait_s") == ["REACH_SYNC_MAX_WAIT_S"]


# --- the README against the code -------------------------------------------------------------


@pytest.mark.parametrize(("code", "status"), sorted(STATUS_BY_CODE.items()))
def test_every_code_of_the_status_table_is_in_the_readme_row_of_its_status(
    code: str, status: int
) -> None:
    rows = error_table(README.read_text(encoding="utf-8"))
    assert code in rows.get(status, set()), f"README's error table: {status} lacks `{code}`"


@pytest.mark.parametrize("field_name", sorted(Settings.model_fields))
def test_every_setting_is_named_in_the_readme_or_docs(field_name: str) -> None:
    text = documented_settings_text()
    missing = [n for n in env_names(field_name) if not re.search(rf"\b{n}\b", text)]
    assert not missing, f"{missing} not in README.md or docs/*.md"


def defined_tests() -> dict[str, set[str]]:
    """The test functions of each test file, by the file's name (two directories may hold a
    file of the same name)."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        defined = re.findall(r"^(?:async )?def (test_\w+)", path.read_text(encoding="utf-8"), re.M)
        found.setdefault(path.name, set()).update(defined)
    return found


def test_every_test_the_docs_name_exists() -> None:
    """``docs/security.md`` and the others name the test that holds each guarantee
    (``test_file.py::test_name``, a ``*`` for a family, or a bare name): a renamed or removed
    test must not leave the docs pointing at nothing."""
    names = defined_tests()
    everywhere = set().union(*names.values())
    missing = []
    for doc in docs():
        text = doc.read_text(encoding="utf-8")
        for file, name in re.findall(r"`(?:[\w/]*/)?(test_\w+\.py)::(test_[\w*]+)`", text):
            if not fnmatch.filter(names.get(file, ()), name):
                missing.append(f"{doc.name}: {file}::{name}")
        for name in re.findall(r"`(test_[\w*]+)`", text):
            if not fnmatch.filter(everywhere, name):
                missing.append(f"{doc.name}: {name}")
        for file in re.findall(r"`(?:tests/[\w/]*/)?(test_\w+\.py)`", text):
            if file not in names:
                missing.append(f"{doc.name}: {file}")
    assert missing == []
