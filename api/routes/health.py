"""Liveness and readiness."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import text

from api.contract import answers
from api.errors import problem
from api.schemas import Readiness
from api.services import services

router = APIRouter(tags=["health"])
CHECK_TIMEOUT_S = 2.0


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up. Says nothing about its dependencies (see ``/readyz``)."""
    return {"status": "ok"}


async def _postgres(request: Request) -> None:
    async with services(request).engine.connect() as conn:
        await conn.execute(text("SELECT 1"))


async def _redis(request: Request) -> None:
    await services(request).redis.ping()


async def _checks(request: Request) -> dict[str, str]:
    checks = {"postgres": _postgres, "redis": _redis}
    results: dict[str, str] = {}
    for name, check in checks.items():
        try:
            async with asyncio.timeout(CHECK_TIMEOUT_S):
                await check(request)
            results[name] = "ok"
        except Exception as exc:
            results[name] = f"unavailable: {type(exc).__name__}"
    return results


@router.get(
    "/readyz",
    response_model=Readiness,
    responses=answers(503, s503="A dependency is unavailable (not_ready); retry after Retry-After"),
)
async def readyz(request: Request) -> JSONResponse:
    """Ready to take work: Postgres and Redis both answer. Asked at most once a second per
    process, whoever asks and however many at once: it needs no key, and each check takes a
    connection every tenant's requests share."""
    results = await services(request).readiness.computed("checks", lambda: _checks(request))
    if all(v == "ok" for v in results.values()):
        return JSONResponse({"status": "ready", "checks": results})
    return problem(
        request,
        503,
        "not_ready",
        "a dependency is unavailable",
        checks=results,
        headers={"Retry-After": "1"},
    )
