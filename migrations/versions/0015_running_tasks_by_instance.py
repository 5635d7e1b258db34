"""running tasks by instance: what the reaper and every lease keeper read each tick

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-05 02:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from migrations.concurrently import create_index

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NAME = "ix_tasks_running_instance_started_at"


def upgrade() -> None:
    # Concurrently, outside the migration's transaction: a plain CREATE INDEX would hold off
    # every claim and finish until it is built.
    create_index(NAME, "tasks", ["instance", "started_at"], where="status = 'running'")


def downgrade() -> None:
    with op.get_context().autocommit_block():
        op.drop_index(NAME, table_name="tasks", postgresql_concurrently=True)
