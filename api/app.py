"""The FastAPI app: the composition root on the API side."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from api import a2a, connections, console, contract, errors, system_gauges
from api.mcp import McpFacade
from api.middleware import TraceMiddleware, TraceparentFromTraceId, WaitingLimit
from api.routes import agents, callbacks, health, metrics, sessions, tasks, webhooks
from api.services import Services
from broker import runtime
from broker.observability import logs, otel
from broker.settings import Settings


def create_app(settings: Settings) -> FastAPI:
    svc = Services.build(settings)
    mcp = McpFacade(svc)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        runtime.tune_collector(settings.gc_gen0_threshold)  # in the process that serves
        runtime.keep_cancels()
        gauges = asyncio.create_task(
            system_gauges.keep_fresh(svc, settings.metrics_refresh_s),
            name="reach-system-gauges",
        )
        stopping = asyncio.create_task(svc.stopping.watch(), name="reach-stopping")
        async with mcp.running():
            # The lifespan's state: uvicorn hands it to each connection's protocol.
            yield {connections.STALL_KEY: settings.client_stall_s}
        for task in (gauges, stopping):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await svc.close()

    logs.capture_context()
    app = FastAPI(
        title="Agent-Reach",
        version="0.1.0",
        summary="Send an envelope to a capability; poll, wait, stream or be called back.",
        description=contract.DESCRIPTION,
        lifespan=lifespan,
        generate_unique_id_function=contract.operation_id,
        docs_url="/docs" if settings.api_docs else None,
        redoc_url="/redoc" if settings.api_docs else None,
    )
    app.state.services = svc
    errors.install(app)
    app.add_middleware(
        WaitingLimit,
        limit=settings.max_requests_waiting,
        per_tenant=settings.max_requests_waiting_per_tenant,
        tenants=svc.tenant_of_key,
    )
    app.add_middleware(TraceMiddleware, otel=settings.otel)
    if settings.otel:
        otel.instrument_api(app)
        # The instrumentation wraps the whole middleware stack; the X-Trace-Id shim must wrap
        # it in turn, so the span it starts continues our trace.
        build_stack = app.build_middleware_stack
        app.build_middleware_stack = lambda: TraceparentFromTraceId(build_stack())  # type: ignore[method-assign]
    app.include_router(health.router)
    app.include_router(tasks.router)
    app.include_router(agents.router)
    app.include_router(metrics.router)
    app.include_router(webhooks.router)
    app.include_router(callbacks.router)
    app.include_router(sessions.router)
    app.include_router(mcp.router)
    a2a.mount(app, svc)
    console.mount(app)
    contract.install(app)
    return app


def create_app_from_env() -> FastAPI:
    """For ``uvicorn api.app:create_app_from_env --factory``: settings from the environment,
    and structured logs (JSON unless in a terminal)."""
    logs.configure()
    settings = Settings()
    if settings.otel:
        otel.setup_tracing("agent-reach-api")
    return create_app(settings)
