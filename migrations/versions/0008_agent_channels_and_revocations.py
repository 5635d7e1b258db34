"""agent channels and revoked versions; room in tasks.queue for instance queues

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02 09:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "agent_channels",
        sa.Column("agent_id", sa.String(length=128), nullable=False),
        sa.Column("channel", sa.String(length=63), nullable=False),
        sa.Column("versions", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column(
            "updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.PrimaryKeyConstraint("agent_id", "channel", name=op.f("pk_agent_channels")),
    )
    op.create_table(
        "agent_revocations",
        sa.Column("agent_id", sa.String(length=128), nullable=False),
        sa.Column("version", sa.String(length=64), nullable=False),
        sa.Column(
            "revoked_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("revoked_by", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("agent_id", "version", name=op.f("pk_agent_revocations")),
    )
    # A hinted task's queue names its instance too; widening a varchar rewrites nothing.
    op.alter_column(
        "tasks", "queue", type_=sa.String(length=512), existing_type=sa.String(length=128)
    )


def downgrade() -> None:
    op.alter_column(
        "tasks", "queue", type_=sa.String(length=128), existing_type=sa.String(length=512)
    )
    op.drop_table("agent_revocations")
    op.drop_table("agent_channels")
