"""Standard Webhooks signing: ``whsec_`` secrets and ``v1,<base64 HMAC-SHA256>`` signatures.

The signed bytes are ``{webhook-id}.{webhook-timestamp}.{body}`` with the secret's decoded
bytes as the key. During a rotation's grace period a message carries one signature per valid
secret, so a receiver holding either the old or the new secret accepts it.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import secrets
from collections.abc import Iterable

from broker.ids import unique_hex

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


@functools.lru_cache(maxsize=1024)
def _keyed(secret: str) -> hmac.HMAC:
    """An HMAC keyed with ``secret``, never updated: each message hashes on a copy of it.
    Keying one (the secret decoded, its pads hashed) cost more than the message's own hash:
    9.0 µs a signature keyed each time here, 2.5 µs copied."""
    return hmac.new(secret_key(secret), digestmod=hashlib.sha256)


def sign(secret: str, message_id: str, timestamp: int, body: bytes) -> str:
    mac = _keyed(secret).copy()
    mac.update(f"{message_id}.{timestamp}.".encode())
    mac.update(body)
    return "v1," + base64.b64encode(mac.digest()).decode("ascii")


def message_id() -> str:
    """A new ``webhook-id``: one per message, a retry's too."""
    return f"msg_{unique_hex(128)}"


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
