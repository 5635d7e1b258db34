"""Sessions: a conversation's state with a revision that only grows. Writes name the
revision they read (``If-Match``); a stale one is ``RevisionConflictError``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from reach_client.models import Page, Session, SessionRevision
from reach_client.plans import Plan, Request, path, query, send
from reach_client.retries import RetryPolicy


def if_match(revision: int) -> dict[str, str]:
    return {"If-Match": f'"{revision}"'}


def create(
    policy: RetryPolicy,
    state: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    ttl_s: int | None = None,
) -> Plan[Session]:
    body: dict[str, Any] = {"state": dict(state or {}), "metadata": dict(metadata or {})}
    if ttl_s is not None:
        body["ttl_s"] = ttl_s
    answer = yield from send(Request("POST", "/sessions", body=body), policy)
    return Session.from_json(answer.json())


def page(
    policy: RetryPolicy, *, limit: int | None = None, cursor: str | None = None
) -> Plan[Page[Session]]:
    """A page of the tenant's live sessions, newest first."""
    answer = yield from send(
        Request("GET", "/sessions", params=query(limit=limit, cursor=cursor)), policy
    )
    doc = answer.json()
    return Page([Session.from_json(s) for s in doc["sessions"]], doc.get("next_cursor"))


def get(policy: RetryPolicy, session_id: str) -> Plan[Session]:
    answer = yield from send(Request("GET", path("sessions", session_id)), policy)
    return Session.from_json(answer.json())


def update(
    policy: RetryPolicy,
    session_id: str,
    state: Mapping[str, Any],
    revision: int,
    metadata: Mapping[str, Any] | None = None,
) -> Plan[Session]:
    """Replace the state (and the metadata, when given) at ``revision``."""
    body: dict[str, Any] = {"state": dict(state)}
    if metadata is not None:
        body["metadata"] = dict(metadata)
    request = Request("PUT", path("sessions", session_id), body=body, headers=if_match(revision))
    answer = yield from send(request, policy)
    return Session.from_json(answer.json())


def patch(
    policy: RetryPolicy, session_id: str, merge_patch: Mapping[str, Any], revision: int
) -> Plan[Session]:
    """An RFC 7396 merge patch of the session: ``{"state": {"cart": None}}`` drops the cart."""
    headers = {**if_match(revision), "Content-Type": "application/merge-patch+json"}
    request = Request(
        "PATCH", path("sessions", session_id), body=dict(merge_patch), headers=headers
    )
    answer = yield from send(request, policy)
    return Session.from_json(answer.json())


def delete(policy: RetryPolicy, session_id: str) -> Plan[None]:
    yield from send(Request("DELETE", path("sessions", session_id)), policy)


def revisions(
    policy: RetryPolicy, session_id: str, limit: int | None = None
) -> Plan[list[SessionRevision]]:
    """The last revisions, newest first."""
    request = Request("GET", path("sessions", session_id, "revisions"), params=query(limit=limit))
    answer = yield from send(request, policy)
    return [SessionRevision.from_json(r) for r in answer.json()["revisions"]]
