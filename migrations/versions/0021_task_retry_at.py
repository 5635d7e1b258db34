"""task retry_at: when a task queued again for a retry is due, so the sweep waits for it

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-06 10:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A nullable column without a default: no row is rewritten. Tasks queued again before it
    # read as never queued again, their wait counted from their creation, as before.
    op.add_column("tasks", sa.Column("retry_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("tasks", "retry_at")
