"""sessions by creation: a tenant's sessions listed newest first, a page at a time

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01 11:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_sessions_tenant_created_at_id",
        "sessions",
        ["tenant", "created_at", "id"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_index("ix_sessions_tenant_created_at_id", table_name="sessions")
