"""sweep reads: queued tasks outside any session by tenant, queue and age; queued tasks with
a deadline by tenant and deadline

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-05 14:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from migrations.concurrently import create_index

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INDEXES = [
    (
        "ix_tasks_queued_no_session_tenant_queue_created_at",
        ["tenant", "queue", "created_at"],
        "status = 'queued' AND session_id IS NULL",
    ),
    (
        "ix_tasks_queued_tenant_deadline_at",
        ["tenant", "deadline_at"],
        "status = 'queued' AND deadline_at IS NOT NULL",
    ),
]


def upgrade() -> None:
    # Concurrently, outside the migration's transaction: a plain CREATE INDEX would hold off
    # every submission until it is built.
    for name, columns, where in INDEXES:
        create_index(name, "tasks", columns, where=where)


def downgrade() -> None:
    with op.get_context().autocommit_block():
        for name, _, _ in INDEXES:
            op.drop_index(name, table_name="tasks", postgresql_concurrently=True)
