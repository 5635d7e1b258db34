"""API keys: ``rk_<key_id>_<secret>``, shown once, stored as a SHA-256 of the secret.

The secret is 256 random bits, so a fast hash is enough: there is nothing to brute-force.
Lookup is by the public ``key_id``; the comparison is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from sqlalchemy import Engine, insert, select, update
from sqlalchemy.sql import func

from broker.capabilities import any_pattern_allows, is_valid_pattern
from broker.db.models import api_keys_table as keys
from broker.errors import BadRequest

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


def create_key(
    engine: Engine,
    tenant: str,
    capabilities: list[str],
    *,
    is_admin: bool = False,
    tenant_admin: bool = False,
    name: str | None = None,
) -> tuple[str, str]:
    """Create a key; returns (key_id, token). The token is not stored and cannot be shown again."""
    bad = [p for p in capabilities if not is_valid_pattern(p)]
    if bad or not capabilities:
        raise BadRequest(
            f"invalid capability patterns: {bad or capabilities}", code="invalid_pattern"
        )
    if not tenant or len(tenant) > 64:
        raise BadRequest("tenant must be 1 to 64 characters", code="invalid_tenant")
    key_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    with engine.begin() as conn:
        conn.execute(
            insert(keys).values(
                key_id=key_id,
                tenant=tenant,
                secret_hash=hash_secret(secret),
                capabilities=capabilities,
                is_admin=is_admin,
                tenant_admin=tenant_admin,
                name=name,
            )
        )
    return key_id, f"{PREFIX}{key_id}_{secret}"


def revoke_key(engine: Engine, key_id: str) -> bool:
    with engine.begin() as conn:
        result = conn.execute(
            update(keys)
            .where(keys.c.key_id == key_id, keys.c.revoked_at.is_(None))
            .values(revoked_at=func.now())
        )
    return result.rowcount == 1


def list_keys(engine: Engine, tenant: str | None = None) -> list[dict[str, object]]:
    query = select(
        keys.c.key_id,
        keys.c.tenant,
        keys.c.capabilities,
        keys.c.is_admin,
        keys.c.tenant_admin,
        keys.c.name,
        keys.c.created_at,
        keys.c.revoked_at,
    ).order_by(keys.c.created_at)
    if tenant is not None:
        query = query.where(keys.c.tenant == tenant)
    with engine.connect() as conn:
        return [dict(row._mapping) for row in conn.execute(query)]
