"""unfinished session turns: an index of a session's queued and running turns only

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-04 17:50:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from migrations.concurrently import create_index

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NAME = "ix_tasks_session_id_session_turn_unfinished"


def upgrade() -> None:
    # Concurrently, outside the migration's transaction, as 0011: tasks is the big table.
    create_index(
        NAME,
        "tasks",
        ["session_id", "session_turn"],
        where="session_id IS NOT NULL AND status IN ('queued', 'running')",
    )


def downgrade() -> None:
    with op.get_context().autocommit_block():
        op.drop_index(NAME, table_name="tasks", postgresql_concurrently=True)
