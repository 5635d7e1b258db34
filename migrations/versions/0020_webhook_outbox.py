"""webhook outbox: the final events whose fanout is owed, written by the task's final write

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-05 19:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A new table: nothing waits for it. Tasks that finished before it are not in it; their
    # fanouts went out as before.
    op.create_table(
        "webhook_outbox",
        sa.Column("task_id", sa.UUID(), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("failures", sa.SmallInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("retry_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("task_id", name=op.f("pk_webhook_outbox")),
    )
    op.create_index(
        "ix_webhook_outbox_finished_at",
        "webhook_outbox",
        ["finished_at"],
        unique=False,
        postgresql_where=sa.text("retry_at IS NULL"),
    )
    op.create_index(
        "ix_webhook_outbox_retry_at",
        "webhook_outbox",
        ["retry_at"],
        unique=False,
        postgresql_where=sa.text("retry_at IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_table("webhook_outbox")
