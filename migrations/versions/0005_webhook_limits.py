"""webhooks: a body kept only while its task is, and the index that counts attempts in flight

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30 16:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.alter_column("webhook_deliveries", "body", existing_type=sa.Text(), nullable=True)
    op.add_column(
        "webhook_deliveries",
        sa.Column("body_expires_at", sa.DateTime(timezone=True), nullable=True),
    )
    # A delivery's body expires with its task; one whose task is gone expires now.
    op.execute(
        "UPDATE webhook_deliveries d SET body_expires_at ="
        " COALESCE((SELECT t.expires_at FROM tasks t WHERE t.id = d.task_id), now())"
    )
    op.alter_column("webhook_deliveries", "body_expires_at", nullable=False)
    op.create_index(
        "ix_webhook_deliveries_body_expires_at",
        "webhook_deliveries",
        ["body_expires_at"],
        unique=False,
        postgresql_where=sa.text("body IS NOT NULL"),
    )
    op.create_index(
        "ix_webhook_deliveries_tenant_sending",
        "webhook_deliveries",
        ["tenant"],
        unique=False,
        postgresql_where=sa.text("status = 'sending'"),
    )


def downgrade() -> None:
    op.drop_index("ix_webhook_deliveries_tenant_sending", table_name="webhook_deliveries")
    op.drop_index("ix_webhook_deliveries_body_expires_at", table_name="webhook_deliveries")
    op.drop_column("webhook_deliveries", "body_expires_at")
    op.execute("UPDATE webhook_deliveries SET body = '' WHERE body IS NULL")
    op.alter_column("webhook_deliveries", "body", existing_type=sa.Text(), nullable=False)
