"""Verifying the calls Agent-Reach signs (Standard Webhooks), in the receiving server::

    from reach_client.webhooks import verify

    event = verify(secret, request_body_bytes, request_headers)   # WebhookVerificationError
    if event.type == "task.succeeded":
        handle(event.task)

Dedupe on the ``webhook-id`` header: it is the same on every retry of one message.
"""

from __future__ import annotations

from collections.abc import Mapping

import standardwebhooks.webhooks as standard

from reach_client.errors import WebhookVerificationError
from reach_client.models import WebhookEvent


def verify(secret: str, body: bytes | str, headers: Mapping[str, str]) -> WebhookEvent:
    """The event, once its signature is one ``secret`` made and its timestamp within five
    minutes of now; else ``WebhookVerificationError``. ``headers`` may be any mapping
    (a framework's headers object): names are matched without regard to case."""
    try:
        document = standard.Webhook(secret).verify(body, {k: v for k, v in headers.items()})
    except standard.WebhookVerificationError as exc:
        raise WebhookVerificationError(str(exc)) from exc
    except (ValueError, RuntimeError, standard.EmptyWebhookSecretError) as exc:
        # A malformed secret or signature header: not ours either.
        raise WebhookVerificationError(f"malformed secret or signature: {exc}") from exc
    if not isinstance(document, dict) or "type" not in document:
        raise WebhookVerificationError("the body is not an Agent-Reach event")
    return WebhookEvent.from_json(document)
