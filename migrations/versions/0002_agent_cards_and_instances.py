"""agent cards and instances

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 22:28:05.071809
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "agent_cards",
        sa.Column("agent_id", sa.String(length=128), nullable=False),
        sa.Column("version", sa.String(length=64), nullable=False),
        sa.Column("capability", sa.String(length=128), nullable=False),
        sa.Column("schema_version", sa.SmallInteger(), nullable=False),
        sa.Column("card", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column(
            "first_seen_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "last_seen_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("agent_id", "version", "capability", name=op.f("pk_agent_cards")),
    )
    op.create_index("ix_agent_cards_capability", "agent_cards", ["capability"], unique=False)
    op.create_table(
        "agent_instances",
        sa.Column("instance", sa.String(length=255), nullable=False),
        sa.Column("hostname", sa.String(length=255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("cards", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("lease_ttl_s", sa.Float(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("stopped_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("instance", name=op.f("pk_agent_instances")),
    )
    op.create_index("ix_tasks_finished_at", "tasks", ["finished_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_tasks_finished_at", table_name="tasks")
    op.drop_table("agent_instances")
    op.drop_index("ix_agent_cards_capability", table_name="agent_cards")
    op.drop_table("agent_cards")
