"""task json sizes: the bytes of a task's metadata and result, kept as they are written

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-06 11:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0022"
down_revision: str | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable, without a default: no row is rewritten. The rows written before it keep NULL,
    # and a listing measures their JSON as text, as before (``broker.db.paging.json_bytes``).
    op.add_column("tasks", sa.Column("metadata_size", sa.Integer(), nullable=True))
    op.add_column("tasks", sa.Column("result_size", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("tasks", "result_size")
    op.drop_column("tasks", "metadata_size")
