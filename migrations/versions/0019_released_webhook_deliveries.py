"""released webhook deliveries: a tenant's pending deliveries marked released, by tenant

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-05 17:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from migrations.concurrently import create_index

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NAME = "ix_webhook_deliveries_released_tenant_lease_until"


def upgrade() -> None:
    # Concurrently, outside the migration's transaction: a plain CREATE INDEX would hold off
    # every fanout and recorded attempt until it is built.
    create_index(
        NAME,
        "webhook_deliveries",
        ["tenant", "lease_until"],
        where="status = 'pending' AND lease_until IS NOT NULL",
    )


def downgrade() -> None:
    with op.get_context().autocommit_block():
        op.drop_index(NAME, table_name="webhook_deliveries", postgresql_concurrently=True)
