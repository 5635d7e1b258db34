"""webhook delivery usage: what a tenant's webhook deliveries and their attempts hold, counted
in tenant_usage

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-06 12:00:00

A delivery is kept ``REACH_WEBHOOK_DELIVERY_TTL_S`` (7 days) whatever its task's TTL, one per
endpoint and event: a tenant with 50 subscriptions wrote 50 rows of about 1.1 KB, row and
index entries, for each task of 5 s, none counted, 950 GB a day within its task rate. Now a
delivery counts its URL, its dedupe key and a kilobyte for the rest of its row and its index
entries, and a kilobyte for each attempt it made: the attempt's log entry (its row, up to 512
characters of the answer, the error, the address) and the delivery's last error. A statement
trigger counts each INSERT (a fanout's deliveries are one statement) and each DELETE (the
sweep's purge, a subscription's deletion that cascades to its deliveries); a row trigger
counts an UPDATE that moves the attempt counter (a claim), one a delivery's attempt.

An attempt's log has no tenant, and goes with its delivery by a cascade that runs before the
delivery's own statement trigger: its bytes are counted by the delivery, from its counter.

The upgrade creates the triggers and counts the deliveries already there in one transaction,
so no write falls between the two: writes to ``webhook_deliveries`` wait for it (1,000,000
deliveries, 361 MB: 5.4 s, a concurrent claim waited 4.2 s). The README says so.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0023"
down_revision: str | None = "0022"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FUNCTIONS = """
CREATE FUNCTION reach_count_delivery_bytes() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'INSERT' THEN
    INSERT INTO tenant_usage AS usage (tenant, shard, bytes)
    SELECT tenant, pg_backend_pid() % 16,
      sum(octet_length(url) + coalesce(octet_length(dedupe_key), 0) + 1024 + attempts * 1024)
    FROM new_rows GROUP BY tenant ORDER BY tenant
    ON CONFLICT (tenant, shard) DO UPDATE SET bytes = usage.bytes + excluded.bytes;
  ELSE
    INSERT INTO tenant_usage AS usage (tenant, shard, bytes)
    SELECT tenant, pg_backend_pid() % 16,
      -sum(octet_length(url) + coalesce(octet_length(dedupe_key), 0) + 1024 + attempts * 1024)
    FROM old_rows GROUP BY tenant ORDER BY tenant
    ON CONFLICT (tenant, shard) DO UPDATE SET bytes = usage.bytes + excluded.bytes;
  END IF;
  RETURN NULL;
END
$$;
CREATE FUNCTION reach_count_delivery_attempts() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO tenant_usage AS usage (tenant, shard, bytes)
  VALUES (NEW.tenant, pg_backend_pid() % 16, (NEW.attempts - OLD.attempts) * 1024)
  ON CONFLICT (tenant, shard) DO UPDATE SET bytes = usage.bytes + excluded.bytes;
  RETURN NULL;
END
$$;
"""

TRIGGERS = """
CREATE TRIGGER deliveries_count_inserted AFTER INSERT ON webhook_deliveries
  REFERENCING NEW TABLE AS new_rows
  FOR EACH STATEMENT EXECUTE FUNCTION reach_count_delivery_bytes();
CREATE TRIGGER deliveries_count_deleted AFTER DELETE ON webhook_deliveries
  REFERENCING OLD TABLE AS old_rows
  FOR EACH STATEMENT EXECUTE FUNCTION reach_count_delivery_bytes();
CREATE TRIGGER deliveries_count_attempts AFTER UPDATE OF attempts ON webhook_deliveries
  FOR EACH ROW WHEN (NEW.attempts <> OLD.attempts)
  EXECUTE FUNCTION reach_count_delivery_attempts();
"""

# What the rows already there hold, with the sign given: added by the upgrade, taken back by
# the downgrade (the tasks' and sessions' bytes stay as 0016 and 0017 count them).
HELD_NOW = """
INSERT INTO tenant_usage AS usage (tenant, shard, bytes)
SELECT tenant, 0,
  :sign * sum(octet_length(url) + coalesce(octet_length(dedupe_key), 0) + 1024 + attempts * 1024)
FROM webhook_deliveries GROUP BY tenant
ON CONFLICT (tenant, shard) DO UPDATE SET bytes = usage.bytes + excluded.bytes
"""


def upgrade() -> None:
    op.execute(FUNCTIONS)
    # The triggers first, then the rows already there: CREATE TRIGGER holds off every write
    # to webhook_deliveries until this transaction ends, so no row is counted twice or missed.
    op.execute(TRIGGERS)
    op.execute(sa.text(HELD_NOW).bindparams(sign=1))


def downgrade() -> None:
    op.execute("DROP TRIGGER deliveries_count_attempts ON webhook_deliveries")
    op.execute("DROP TRIGGER deliveries_count_deleted ON webhook_deliveries")
    op.execute("DROP TRIGGER deliveries_count_inserted ON webhook_deliveries")
    op.execute("DROP FUNCTION reach_count_delivery_attempts()")
    op.execute("DROP FUNCTION reach_count_delivery_bytes()")
    op.execute(sa.text(HELD_NOW).bindparams(sign=-1))
