"""``/console``: the web console, plain files shipped in this package.

The page is static (HTML, a few ES modules and CSS); it signs in with an API key kept in the
browser's ``sessionStorage`` and does everything through the same HTTP API as any client,
with ``Authorization: Bearer``, so a key sees in the console exactly what it may see anywhere.
Nothing is fetched from elsewhere: the content security policy allows this origin only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from starlette.responses import Response
from starlette.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send

STATIC = Path(__file__).resolve().parent / "static"
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

router = APIRouter(include_in_schema=False)


# The request headers a file is served whole without: Starlette answers a malformed Range
# 400 and one past the file 416 itself, in text/plain (an audit, 2026-12-06), and the
# console's files are a few KiB, too small for parts of them to be worth asking for.
RANGE_HEADERS = (b"range", b"if-range")


def _whole(scope: Scope) -> Scope:
    headers = [(k, v) for k, v in scope["headers"] if k.lower() not in RANGE_HEADERS]
    return {**scope, "headers": headers}


class WholeFile(FileResponse):
    """A console file, always whole (``RANGE_HEADERS``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.headers["accept-ranges"] = "none"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await super().__call__(_whole(scope), receive, send)


class ConsoleFiles(StaticFiles):
    """The console's files, whole. The page is among them, and served from here it takes the
    headers ``/console`` gives it (else it could be framed); the others are not pages, and
    take every response's (``api.middleware``)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await super().__call__(_whole(scope), receive, send)

    def file_response(self, *args: Any, **kwargs: Any) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers["accept-ranges"] = "none"
        if response.media_type == "text/html":
            response.headers.update(HEADERS)
        return response


@router.get("/console")
async def console() -> FileResponse:
    """The console's single page; its views are addressed by the fragment (``#/tasks``)."""
    return WholeFile(STATIC / "index.html", headers=HEADERS)


def mount(app: FastAPI) -> None:
    app.include_router(router)
    app.mount("/console/static", ConsoleFiles(directory=STATIC), name="console-static")
