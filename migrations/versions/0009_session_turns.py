"""session turns: each session task's place in its session's order

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01 05:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "sessions", sa.Column("turns", sa.Integer(), server_default=sa.text("0"), nullable=False)
    )
    op.add_column("tasks", sa.Column("session_turn", sa.Integer(), nullable=True))
    op.create_index(
        "ix_tasks_session_id_session_turn",
        "tasks",
        ["session_id", "session_turn"],
        unique=False,
        postgresql_where=sa.text("session_id IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index(
        "ix_tasks_session_id_session_turn",
        table_name="tasks",
        postgresql_where=sa.text("session_id IS NOT NULL"),
    )
    op.drop_column("tasks", "session_turn")
    op.drop_column("sessions", "turns")
