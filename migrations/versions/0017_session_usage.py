"""session usage: what a tenant's sessions and their revisions hold, counted in tenant_usage

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-05 07:05:00

A session holds its state, its metadata and a kilobyte for the rest of its row, and each
revision kept its copy of the state and a kilobyte (``broker.tenancy.usage``). Triggers add
them to the tenant's rows of ``tenant_usage``, beside its tasks' bytes (0016), in the same
transaction as the statement that writes them, whichever code ran it: the API's creates and
writes, a task's ``ctx.session``, the revisions a write lets go, the janitor (and the
revisions its deletes cascade to). An UPDATE counts only when it sets the state or the
metadata, by a row trigger: a session's turn counter moves with each of its tasks, and a
statement trigger there would measure its state twice for every one.

The sizes are the JSON as Postgres prints it (``octet_length(state::text)``): the same value
measures the same on the way in and on the way out, toasted or not.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FUNCTIONS = """
CREATE FUNCTION reach_count_session_bytes() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'INSERT' THEN
    INSERT INTO tenant_usage AS usage (tenant, shard, bytes)
    SELECT tenant, pg_backend_pid() % 16,
      sum(octet_length(state::text) + octet_length(metadata::text) + 1024)
    FROM new_rows GROUP BY tenant ORDER BY tenant
    ON CONFLICT (tenant, shard) DO UPDATE SET bytes = usage.bytes + excluded.bytes;
  ELSE
    INSERT INTO tenant_usage AS usage (tenant, shard, bytes)
    SELECT tenant, pg_backend_pid() % 16,
      -sum(octet_length(state::text) + octet_length(metadata::text) + 1024)
    FROM old_rows GROUP BY tenant ORDER BY tenant
    ON CONFLICT (tenant, shard) DO UPDATE SET bytes = usage.bytes + excluded.bytes;
  END IF;
  RETURN NULL;
END
$$;
CREATE FUNCTION reach_count_revision_bytes() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'INSERT' THEN
    INSERT INTO tenant_usage AS usage (tenant, shard, bytes)
    SELECT tenant, pg_backend_pid() % 16, sum(octet_length(state::text) + 1024)
    FROM new_rows GROUP BY tenant ORDER BY tenant
    ON CONFLICT (tenant, shard) DO UPDATE SET bytes = usage.bytes + excluded.bytes;
  ELSE
    INSERT INTO tenant_usage AS usage (tenant, shard, bytes)
    SELECT tenant, pg_backend_pid() % 16, -sum(octet_length(state::text) + 1024)
    FROM old_rows GROUP BY tenant ORDER BY tenant
    ON CONFLICT (tenant, shard) DO UPDATE SET bytes = usage.bytes + excluded.bytes;
  END IF;
  RETURN NULL;
END
$$;
CREATE FUNCTION reach_count_session_rewritten() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO tenant_usage AS usage (tenant, shard, bytes)
  VALUES (NEW.tenant, pg_backend_pid() % 16,
    octet_length(NEW.state::text) + octet_length(NEW.metadata::text)
    - octet_length(OLD.state::text) - octet_length(OLD.metadata::text))
  ON CONFLICT (tenant, shard) DO UPDATE SET bytes = usage.bytes + excluded.bytes;
  RETURN NULL;
END
$$;
"""

TRIGGERS = """
CREATE TRIGGER sessions_count_inserted AFTER INSERT ON sessions
  REFERENCING NEW TABLE AS new_rows
  FOR EACH STATEMENT EXECUTE FUNCTION reach_count_session_bytes();
CREATE TRIGGER sessions_count_deleted AFTER DELETE ON sessions
  REFERENCING OLD TABLE AS old_rows
  FOR EACH STATEMENT EXECUTE FUNCTION reach_count_session_bytes();
CREATE TRIGGER sessions_count_rewritten AFTER UPDATE OF state, metadata ON sessions
  FOR EACH ROW EXECUTE FUNCTION reach_count_session_rewritten();
CREATE TRIGGER revisions_count_inserted AFTER INSERT ON session_revisions
  REFERENCING NEW TABLE AS new_rows
  FOR EACH STATEMENT EXECUTE FUNCTION reach_count_revision_bytes();
CREATE TRIGGER revisions_count_deleted AFTER DELETE ON session_revisions
  REFERENCING OLD TABLE AS old_rows
  FOR EACH STATEMENT EXECUTE FUNCTION reach_count_revision_bytes();
"""

# What the rows already there hold, with the sign given: added by the upgrade, taken back by
# the downgrade (the tasks' bytes stay as 0016 counts them).
HELD_NOW = """
INSERT INTO tenant_usage AS usage (tenant, shard, bytes)
SELECT tenant, 0, :sign * sum(bytes) FROM (
  SELECT tenant, octet_length(state::text) + octet_length(metadata::text) + 1024 AS bytes
  FROM sessions
  UNION ALL
  SELECT tenant, octet_length(state::text) + 1024 FROM session_revisions
) held GROUP BY tenant
ON CONFLICT (tenant, shard) DO UPDATE SET bytes = usage.bytes + excluded.bytes
"""


def upgrade() -> None:
    op.execute(FUNCTIONS)
    # The triggers first, then the rows already there: CREATE TRIGGER holds off every write
    # to both tables until this transaction ends, so no row is counted twice or missed.
    op.execute(TRIGGERS)
    op.execute(sa.text(HELD_NOW).bindparams(sign=1))


def downgrade() -> None:
    op.execute("DROP TRIGGER revisions_count_deleted ON session_revisions")
    op.execute("DROP TRIGGER revisions_count_inserted ON session_revisions")
    op.execute("DROP TRIGGER sessions_count_rewritten ON sessions")
    op.execute("DROP TRIGGER sessions_count_deleted ON sessions")
    op.execute("DROP TRIGGER sessions_count_inserted ON sessions")
    op.execute("DROP FUNCTION reach_count_session_rewritten()")
    op.execute("DROP FUNCTION reach_count_revision_bytes()")
    op.execute("DROP FUNCTION reach_count_session_bytes()")
    op.execute(sa.text(HELD_NOW).bindparams(sign=-1))
