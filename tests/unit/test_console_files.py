"""The console's files: each is shipped in the wheel, and the page names only files that exist
in this package (nothing from another origin)."""

from __future__ import annotations

import re
import tomllib
from fnmatch import fnmatch
from pathlib import Path

from api.console import STATIC

ROOT = Path(__file__).resolve().parents[2]


def test_every_console_file_is_package_data() -> None:
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["api.console"]
    files = [p.relative_to(STATIC.parent).as_posix() for p in STATIC.rglob("*") if p.is_file()]
    assert files
    assert [f for f in files if not any(fnmatch(f, p) for p in patterns)] == []


def test_the_page_and_its_modules_name_only_files_of_the_package() -> None:
    page = (STATIC / "index.html").read_text()
    named = re.findall(r'(?:src|href)="console/static/([^"]+)"', page)
    assert named, "the page names its files as this test reads them"
    for name in named:
        assert (STATIC / name).is_file(), name
    imported = 0
    for module in STATIC.glob("*.js"):
        for name in re.findall(r'from "\./([^"]+)"', module.read_text()):
            imported += 1
            assert (STATIC / name).is_file(), f"{module.name} imports {name}"
    assert imported, "the modules import one another as this test reads them"
    every = "".join(p.read_text() for p in STATIC.iterdir())
    # The SVG namespace is a name (createElementNS), never fetched.
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg\")", every)
