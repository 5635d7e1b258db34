"""API keys in Postgres: create (the token is shown once), revoke, list, and look one up."""

from __future__ import annotations

import secrets
from typing import Any

from sqlalchemy import Engine, insert, select, update
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.sql import func

from broker.db.models import api_keys_table as keys
from broker.errors import BadRequest
from broker.registry.capabilities import is_valid_pattern
from broker.tenancy.keys import PREFIX, hash_secret

# The columns' lengths (``broker.db.models.ApiKey``).
MAX_TENANT = 64
MAX_NAME = 128


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
    if not capabilities:
        raise BadRequest("a key allows at least one capability pattern", code="invalid_pattern")
    bad = [p for p in capabilities if not is_valid_pattern(p)]
    if bad:
        raise BadRequest(f"invalid capability patterns: {bad}", code="invalid_pattern")
    # No white space at either end: " " was a tenant, and "acme " another than "acme".
    if (
        not tenant
        or len(tenant) > MAX_TENANT
        or not tenant.isprintable()
        or tenant != tenant.strip()
    ):
        raise BadRequest(
            f"tenant must be 1 to {MAX_TENANT} printable characters, with no white space at "
            "either end",
            code="invalid_tenant",
        )
    name = name or None  # "" is no name
    if name is not None and (len(name) > MAX_NAME or not name.isprintable()):
        raise BadRequest(
            f"a key's name is at most {MAX_NAME} printable characters", code="invalid_name"
        )
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


async def get_key(engine: AsyncEngine, key_id: str) -> dict[str, Any] | None:
    query = select(keys).where(keys.c.key_id == key_id, keys.c.revoked_at.is_(None))
    async with engine.connect() as conn:
        row = (await conn.execute(query)).first()
    return dict(row._mapping) if row is not None else None
