"""Standard Webhooks signing: ``whsec_`` secrets and ``v1,<base64 HMAC-SHA256>`` signatures.

The signed bytes are ``{webhook-id}.{webhook-timestamp}.{body}`` with the secret's decoded
bytes as the key. During a rotation's grace period a message carries one signature per valid
secret, so a receiver holding either the old or the new secret accepts it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Iterable

PREFIX = "whsec_"
SECRET_BYTES = 32  # the spec allows 24 to 64


def new_secret(size: int = SECRET_BYTES) -> str:
    if not 24 <= size <= 64:
        raise ValueError("a webhook secret has 24 to 64 random bytes")
    return PREFIX + base64.b64encode(secrets.token_bytes(size)).decode("ascii")


def secret_key(secret: str) -> bytes:
    """The HMAC key: the base64-decoded part after ``whsec_``."""
    if not secret.startswith(PREFIX):
        raise ValueError("a webhook secret starts with whsec_")
    return base64.b64decode(secret[len(PREFIX) :], validate=True)


def sign(secret: str, message_id: str, timestamp: int, body: bytes) -> str:
    signed = f"{message_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret_key(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode("ascii")


def signature_header(
    valid_secrets: Iterable[str], message_id: str, timestamp: int, body: bytes
) -> str:
    """The ``webhook-signature`` value: space-separated signatures, one per valid secret."""
    return " ".join(sign(s, message_id, timestamp, body) for s in valid_secrets)


def headers(
    valid_secrets: Iterable[str], message_id: str, timestamp: int, body: bytes
) -> dict[str, str]:
    """The three Standard Webhooks headers of one attempt."""
    return {
        "webhook-id": message_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signature_header(valid_secrets, message_id, timestamp, body),
    }
