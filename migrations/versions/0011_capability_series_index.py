"""capability series: an index of a tenant's finished tasks by serving capability, finished_at

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-08 09:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from migrations.concurrently import create_index

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NAME = "ix_tasks_tenant_served_finished_at"


def upgrade() -> None:
    # Concurrently, outside the migration's transaction: tasks is the big table, and a plain
    # CREATE INDEX would hold off every submission until the index is built.
    create_index(
        NAME,
        "tasks",
        ["tenant", sa.text("split_part(queue, '@', 1)"), "finished_at"],
        where="finished_at IS NOT NULL",
    )


def downgrade() -> None:
    with op.get_context().autocommit_block():
        op.drop_index(NAME, table_name="tasks", postgresql_concurrently=True)
