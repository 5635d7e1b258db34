from __future__ import annotations

import httpx

from tests.integration.stack import ServedApp


def test_healthz_and_readyz_answer_without_a_key(api: ServedApp) -> None:
    with httpx.Client(base_url=api.url) as http:
        assert http.get("/healthz").json() == {"status": "ok"}
        ready = http.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["checks"] == {"postgres": "ok", "redis": "ok"}


def test_a_caller_trace_id_is_kept_and_a_junk_one_replaced(api: ServedApp) -> None:
    with httpx.Client(base_url=api.url) as http:
        kept = http.get("/healthz", headers={"X-Trace-Id": "0af7651916cd43dd8448eb211c80319c"})
        junk = http.get("/healthz", headers={"X-Trace-Id": "../../etc"})
    assert kept.headers["x-trace-id"] == "0af7651916cd43dd8448eb211c80319c"
    assert len(junk.headers["x-trace-id"]) == 32
    assert junk.headers["x-trace-id"] != "../../etc"


def test_the_openapi_document_describes_the_envelope(api: ServedApp) -> None:
    with httpx.Client(base_url=api.url) as http:
        spec = http.get("/openapi.json").json()
        docs = http.get("/docs")
    body = spec["paths"]["/tasks"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/Envelope"}
    envelope = spec["components"]["schemas"]["Envelope"]
    assert set(envelope["required"]) == {"capability", "payload"}
    assert docs.status_code == 200
