"""Optional OpenTelemetry: the extra ``otel``, off unless ``REACH_OTEL=true``.

When on, the FastAPI and Celery instrumentations make spans, and our trace id is the trace's:
a caller's ``traceparent`` is used by both; an ``X-Trace-Id`` alone is turned into a
``traceparent`` before the instrumentation sees the request; with neither, the API adopts the
trace id the instrumentation made. Spans go to an OTLP collector when the standard
``OTEL_EXPORTER_OTLP_ENDPOINT`` is set.
"""

from __future__ import annotations

import os
from typing import Any

_ZERO = "0" * 32


def setup_tracing(service_name: str, exporter: Any = None) -> None:
    """A tracer provider for this process (the exporter is for tests; OTLP by default)."""
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)


def current_trace_id() -> str | None:
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    trace_id = f"{context.trace_id:032x}"
    return trace_id if context.is_valid and trace_id != _ZERO else None


def instrument_api(app: Any) -> None:
    """Call after our own middleware is added: the instrumentation then wraps it, so a span
    exists when our trace id is chosen."""
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    FastAPIInstrumentor.instrument_app(app)


def instrument_celery() -> None:
    from opentelemetry.instrumentation.celery import CeleryInstrumentor

    CeleryInstrumentor().instrument()  # type: ignore[no-untyped-call]
