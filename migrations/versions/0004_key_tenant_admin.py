"""api_keys.tenant_admin

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30 16:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Existing keys stay limited to their patterns; an operator grants tenant admin anew.
    op.add_column(
        "api_keys",
        sa.Column("tenant_admin", sa.Boolean(), server_default=sa.text("false"), nullable=False),
    )


def downgrade() -> None:
    op.drop_column("api_keys", "tenant_admin")
