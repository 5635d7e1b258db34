"""The console's files are served whole, whatever Range a request names: Starlette answered a
malformed one 400 and one past the file 416 itself, in text/plain, where every other error
is problem+json (an audit, 2026-12-06); the files are a few KiB, too small for parts."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.stack import ServedApp

RANGES = ["items=0-1", "bytes=5-2", "bytes=99999999-", "bytes=0-1"]


@pytest.mark.parametrize("path", ["/console", "/console/static/app.js"])
@pytest.mark.parametrize("asked", RANGES)
def test_a_console_file_is_served_whole_whatever_range_is_asked(
    api: ServedApp, path: str, asked: str
) -> None:
    whole = httpx.get(f"{api.url}{path}")
    ranged = httpx.get(f"{api.url}{path}", headers={"Range": asked, "If-Range": "x"})
    assert whole.status_code == 200
    assert (ranged.status_code, ranged.content) == (200, whole.content)
    assert ranged.headers["accept-ranges"] == "none"
