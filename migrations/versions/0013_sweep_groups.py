"""sweep groups: queued tasks by tenant and queue, pending deliveries by tenant

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-04 18:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from migrations.concurrently import create_index

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INDEXES = [
    (
        "ix_tasks_queued_tenant_queue_created_at",
        "tasks",
        ["tenant", "queue", "created_at"],
        "status = 'queued'",
    ),
    (
        "ix_webhook_deliveries_pending_tenant_next_attempt_at",
        "webhook_deliveries",
        ["tenant", "next_attempt_at"],
        "status = 'pending'",
    ),
]


def upgrade() -> None:
    # Concurrently, outside the migration's transaction: a plain CREATE INDEX would hold off
    # every submission (and every delivery's write) until it is built.
    for name, table, columns, where in INDEXES:
        create_index(name, table, columns, where=where)


def downgrade() -> None:
    with op.get_context().autocommit_block():
        for name, table, _, _ in INDEXES:
            op.drop_index(name, table_name=table, postgresql_concurrently=True)
