"""``CREATE INDEX CONCURRENTLY`` that a try given up part way does not stop for good.

Built concurrently, an index is written into the catalog first and then waits for the
transactions already writing its table. When that wait passes ``lock_timeout``
(``reach.migrate``), the try fails but the index stays, marked invalid, outside any
transaction that could roll it back: the next try's ``CREATE INDEX`` found the name taken,
and every try after it failed the same way until someone dropped the index by hand. Here an
invalid index of the name is dropped first, and a valid one (a migration of two indexes
that built its first before giving up) is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

# Whether the index ``name`` is valid; no row when there is none.
_VALID = sa.text("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(:name)")


def create_index(name: str, table: str, columns: Sequence[Any], *, where: str) -> None:
    """The partial index ``name`` on ``table``, built concurrently, outside the migration's
    transaction: a plain ``CREATE INDEX`` would hold off every write of the table until it
    is built."""
    with op.get_context().autocommit_block():
        valid = op.get_bind().execute(_VALID, {"name": name}).scalar()
        if valid is False:
            op.drop_index(name, table_name=table, postgresql_concurrently=True)
        op.create_index(
            name,
            table,
            list(columns),
            unique=False,
            postgresql_where=sa.text(where),
            postgresql_concurrently=True,
            if_not_exists=True,
        )
