"""``/metrics`` for Prometheus: the API's counters and the system gauges as of their last
refresh (``api.system_gauges``, every ``metrics_refresh_s``). A scrape reads no database: the
counters of this process, or under ``reach api --workers N`` of all N, merged from the files
they count in (``broker.observability.metrics_dirs``).

Closed by default: with ``metrics_token`` set it needs ``Authorization: Bearer <token>``
(compared in constant time); without one it is 404 unless ``metrics_public`` (the dev stack).
"""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from api.contract import BEARER, answers
from api.services import services
from broker.errors import NotFound, Unauthenticated
from broker.observability import metrics

router = APIRouter(tags=["health"])


def _authorize(request: Request) -> None:
    settings = services(request).settings
    if settings.metrics_token is None:
        if settings.metrics_public:
            return
        # As a route that is not there: a code of the README's, none of its own
        raise NotFound(
            "metrics are served only with REACH_METRICS_TOKEN set", code="route_not_found"
        )
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    expected = settings.metrics_token.get_secret_value().encode()
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
        raise Unauthenticated("the metrics token is required: Authorization: Bearer <token>")


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {
            "description": "Prometheus text exposition format",
            "content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
        },
        **answers(
            401,
            404,
            s401="The metrics token is required",
            s404="Metrics are not served: no metrics token is set",
        ),
    },
    openapi_extra={"security": [{BEARER: []}]},
)
async def prometheus_metrics(request: Request) -> Response:
    """Prometheus text format. Holds no tenant data: counts by route, capability and code."""
    _authorize(request)
    registry = metrics.merged_registry() if metrics.shared() else REGISTRY
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
