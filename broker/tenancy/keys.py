"""API keys: ``rk_<key_id>_<secret>``, shown once, stored as a SHA-256 of the secret.

The secret is 256 random bits, so a fast hash is enough: there is nothing to brute-force.
Lookup is by the public ``key_id``; the comparison is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from broker.registry.capabilities import any_pattern_allows

PREFIX = "rk_"


@dataclass(frozen=True)
class Principal:
    """Who is calling: the tenant and what its key may run.

    ``capabilities`` bound what the key runs and what of its tenant it reads. A tenant-admin
    key reads all of its tenant's tasks and webhooks and manages the tenant's settings; an
    operator key (``is_admin``) is a tenant admin too, and also sees the infrastructure.
    """

    key_id: str
    tenant: str
    capabilities: tuple[str, ...]
    is_admin: bool = False
    tenant_admin: bool = False

    @property
    def manages_tenant(self) -> bool:
        return self.tenant_admin or self.is_admin

    @property
    def sees(self) -> tuple[str, ...]:
        """The patterns that bound which of its tenant's tasks and webhooks this key reads."""
        return ("*",) if self.manages_tenant else self.capabilities

    def may_see(self, capability: str) -> bool:
        return any_pattern_allows(self.sees, capability)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def split_token(token: str) -> tuple[str, str] | None:
    """``rk_<key_id>_<secret>`` -> (key_id, secret); None when it is not of that form."""
    if not token.startswith(PREFIX):
        return None
    key_id, sep, secret = token[len(PREFIX) :].partition("_")
    if not sep or not key_id or not secret or len(key_id) > 32:
        return None
    return key_id, secret


def secret_matches(secret: str, stored_hash: str) -> bool:
    return hmac.compare_digest(hash_secret(secret), stored_hash)
