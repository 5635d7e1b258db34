"""shared webhook bodies: one stored body for every endpoint of an event

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-04 21:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TZ = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "webhook_bodies",
        sa.Column("id", postgresql.UUID(as_uuid=True), primary_key=True),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("expires_at", TZ, nullable=False),
    )
    op.create_index("ix_webhook_bodies_expires_at", "webhook_bodies", ["expires_at"])
    op.add_column(
        "webhook_deliveries",
        sa.Column(
            "body_id",
            postgresql.UUID(as_uuid=True),
            sa.ForeignKey("webhook_bodies.id", ondelete="SET NULL"),
            nullable=True,
        ),
    )
    # Each stored body moves to a row of its own, under its delivery's id.
    op.execute(
        "INSERT INTO webhook_bodies (id, body, expires_at)"
        " SELECT id, body, body_expires_at FROM webhook_deliveries WHERE body IS NOT NULL"
    )
    op.execute("UPDATE webhook_deliveries SET body_id = id WHERE body IS NOT NULL")
    op.drop_index("ix_webhook_deliveries_body_expires_at", table_name="webhook_deliveries")
    op.drop_column("webhook_deliveries", "body")
    op.create_index(
        "ix_webhook_deliveries_body_expires_at",
        "webhook_deliveries",
        ["body_expires_at"],
        postgresql_where=sa.text("body_id IS NOT NULL"),
    )
    # A body's removal finds the deliveries that name it (ON DELETE SET NULL).
    op.create_index(
        "ix_webhook_deliveries_body_id",
        "webhook_deliveries",
        ["body_id"],
        postgresql_where=sa.text("body_id IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_webhook_deliveries_body_id", table_name="webhook_deliveries")
    op.drop_index("ix_webhook_deliveries_body_expires_at", table_name="webhook_deliveries")
    op.add_column("webhook_deliveries", sa.Column("body", sa.Text(), nullable=True))
    op.execute(
        "UPDATE webhook_deliveries AS d SET body = b.body FROM webhook_bodies AS b"
        " WHERE b.id = d.body_id"
    )
    op.drop_column("webhook_deliveries", "body_id")
    op.create_index(
        "ix_webhook_deliveries_body_expires_at",
        "webhook_deliveries",
        ["body_expires_at"],
        postgresql_where=sa.text("body IS NOT NULL"),
    )
    op.drop_index("ix_webhook_bodies_expires_at", table_name="webhook_bodies")
    op.drop_table("webhook_bodies")
