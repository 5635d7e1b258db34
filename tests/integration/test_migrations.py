"""Alembic is the only way the schema changes: from empty it must build exactly the models,
and every migration must go down and up again."""

from __future__ import annotations

import functools
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from broker.db.models import Base
from reach import cli, localservices, migrate

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def empty_database(services: localservices.Services) -> Iterator[str]:
    name = f"reach_mig_{secrets.token_hex(4)}"
    url = localservices.create_database(services.database_url, name)
    yield url
    localservices.drop_database(services.database_url, name)


def schema_diff(url: str) -> list[object]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            diff: list[object] = compare_metadata(MigrationContext.configure(conn), Base.metadata)
            return diff
    finally:
        engine.dispose()


def tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_from_empty_equals_the_models(empty_database: str) -> None:
    migrate.upgrade(empty_database)
    assert schema_diff(empty_database) == []


def test_downgrade_to_base_and_upgrade_again(empty_database: str) -> None:
    migrate.upgrade(empty_database)
    migrate.downgrade(empty_database, "base")
    assert tables(empty_database) == {"alembic_version"}
    migrate.upgrade(empty_database)
    assert {"tasks", "api_keys"} <= tables(empty_database)
    assert schema_diff(empty_database) == []


def test_an_empty_database_differs_from_the_models(empty_database: str) -> None:
    # The comparison above is only worth something if it can see a difference.
    assert schema_diff(empty_database) != []


def test_a_migration_that_cannot_take_its_lock_gives_up_and_says_so_then_goes_through(
    empty_database: str,
) -> None:
    # Given a database one migration behind, and a session reading tasks in a long transaction
    migrate.upgrade(empty_database, "0021")
    with psycopg.connect(localservices.libpq_url(empty_database)) as reader:
        reader.execute("SELECT count(*) FROM tasks").fetchone()  # holds ACCESS SHARE on tasks
        # When the next migration (an ALTER TABLE on tasks) is run, its tries bounded
        # Then each try gives its lock up rather than queue every session behind it, and the
        # run fails saying why (before: it waited for as long as the reader lived)
        with pytest.raises(migrate.MigrationBlocked, match="could not take their locks"):
            migrate.upgrade(empty_database, lock_timeout_s=0.2, tries=2, pause_s=0.1)
        assert reader.execute("SELECT count(*) FROM tasks").fetchone() == (0,)
    # And once the reader is gone it goes through
    migrate.upgrade(empty_database)
    assert schema_diff(empty_database) == []


# Each run imports first, then waits for a line on stdin: both start migrating at once.
RUN_AT_THE_SIGNAL = """
import sys
from reach import migrate
sys.stdin.readline()
migrate.upgrade(sys.argv[1])
"""


def test_two_migrations_at_once_both_succeed_one_after_the_other(empty_database: str) -> None:
    # Given two runs of the migrations on one empty database, started at the same moment
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", RUN_AT_THE_SIGNAL, empty_database],
            stdin=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for _ in range(2)
    ]
    for run in runs:
        assert run.stdin is not None
        run.stdin.write("go\n")
        run.stdin.flush()
    # When both have ended
    ended = [(run.wait(timeout=120), run.communicate()[1]) for run in runs]
    # Then both succeeded, the second finding nothing left to do (before: one failed, a unique
    # violation on alembic_version or a deadlock), and the schema is the models'
    assert [code for code, _ in ended] == [0, 0], ended
    assert schema_diff(empty_database) == []


def test_a_migration_waits_for_the_one_running_then_gives_up_saying_so(
    empty_database: str,
) -> None:
    # Given a session holding the migration lock, as a run in progress does
    with psycopg.connect(localservices.libpq_url(empty_database), autocommit=True) as running:
        running.execute("SELECT pg_advisory_lock(%s)", (migrate.MIGRATION_LOCK,))
        # When another run's tries are spent waiting for it
        # Then it fails saying why, having changed nothing
        with pytest.raises(migrate.MigrationBlocked, match="another migration is running"):
            migrate.upgrade(empty_database, lock_timeout_s=0.2, tries=2, pause_s=0.1)
        assert tables(empty_database) == set()
    # And once the lock is let go it goes through
    migrate.upgrade(empty_database)
    assert schema_diff(empty_database) == []


def test_reach_migrate_says_in_one_line_that_it_could_not_take_its_locks(
    empty_database: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Given a session holding the migration lock, and tries shortened from 80 s in all
    monkeypatch.setenv("REACH_DATABASE_URL", empty_database)
    monkeypatch.setattr(
        migrate, "upgrade", functools.partial(migrate.upgrade, lock_timeout_s=0.2, pause_s=0.1)
    )
    with psycopg.connect(localservices.libpq_url(empty_database), autocommit=True) as running:
        running.execute("SELECT pg_advisory_lock(%s)", (migrate.MIGRATION_LOCK,))
        # When `reach migrate` is run (before: a MigrationBlocked traceback)
        status = cli.main(["migrate"])
    # Then it says why in one line, with the exit status of any refusal
    assert status == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the migrations could not take their locks in 6 tries"), err
    assert "\n" not in err


def test_the_alembic_command_waits_for_the_migration_lock_too(empty_database: str) -> None:
    # Given a session holding the migration lock
    with psycopg.connect(localservices.libpq_url(empty_database), autocommit=True) as running:
        running.execute("SELECT pg_advisory_lock(%s)", (migrate.MIGRATION_LOCK,))
        # When ``alembic upgrade head`` is run (alembic.ini: the same as ``reach migrate``)
        env = {**os.environ, "REACH_DATABASE_URL": empty_database}
        env.pop("DATABASE_URL", None)
        alembic = subprocess.Popen(
            [sys.executable, "-m", "alembic", "upgrade", "head"],
            cwd=ROOT,
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        # Then it waits for it, having changed nothing
        with pytest.raises(subprocess.TimeoutExpired):
            alembic.wait(timeout=3)
        assert tables(empty_database) == set()
    # And migrates once it is let go
    assert alembic.wait(timeout=60) == 0, alembic.communicate()[1]
    assert schema_diff(empty_database) == []


# Two tenants' deliveries (the second's a fanout's worth, attempted twice) and a task.
POPULATED = """
INSERT INTO tasks (id, tenant, capability, queue, status, payload, payload_digest, payload_size,
  trace_id, result_ttl_s, expires_at)
VALUES (gen_random_uuid(), 'a', 'echo', 'echo', 'queued', '{}', 'd', 2, 't', 60,
  now() + interval '1 hour');
INSERT INTO webhook_deliveries (id, tenant, task_id, event_type, dedupe_key, url,
  body_expires_at, trace_id, status, attempts, final_attempt, next_attempt_at, expires_at)
SELECT gen_random_uuid(), CASE WHEN i <= 3 THEN 'a' ELSE 'b' END, gen_random_uuid(),
  'task.succeeded', 'k' || i, 'http://127.0.0.1:9/hook/' || i, now(), md5(i::text), 'dead',
  CASE WHEN i <= 3 THEN 1 ELSE 2 END, 5, now(), now() + interval '7 days'
FROM generate_series(1, 53) AS i
"""
TASK = 2 + 2 + 1024  # its payload, its metadata ({}) and 1 KiB
HELD = "SELECT tenant, sum(bytes) FROM tenant_usage GROUP BY tenant HAVING sum(bytes) <> 0"
ONE_MORE = """
INSERT INTO webhook_deliveries (id, tenant, task_id, event_type, url, body_expires_at, trace_id,
  status, attempts, final_attempt, next_attempt_at, expires_at)
VALUES (gen_random_uuid(), 'b', gen_random_uuid(), 'task.progress', 'http://127.0.0.1:9/x',
  now(), 't', 'pending', 0, 5, now(), now() + interval '7 days')
"""


def test_0023_counts_the_deliveries_already_written_and_its_downgrade_takes_them_back(
    empty_database: str,
) -> None:
    # Given deliveries written before 0023, which nothing counted
    migrate.upgrade(empty_database, "0022")
    with psycopg.connect(localservices.libpq_url(empty_database), autocommit=True) as conn:
        conn.execute(POPULATED)
        assert dict(conn.execute(HELD).fetchall()) == {"a": TASK}
    # When it goes up: each delivery counts its url, its dedupe key, 1 KiB and 1 KiB an attempt
    migrate.upgrade(empty_database)
    url = len("http://127.0.0.1:9/hook/") + 1  # the first nine; the rest have 2-digit numbers
    a = 3 * (url + 2 + 1024 + 1024) + TASK
    b = 6 * (url + 2 + 1024 + 2048) + 44 * (url + 1 + 3 + 1024 + 2048)
    with psycopg.connect(localservices.libpq_url(empty_database), autocommit=True) as conn:
        assert dict(conn.execute(HELD).fetchall()) == {"a": a, "b": b}
        conn.execute(ONE_MORE)  # and what is written next counts too
        assert dict(conn.execute(HELD).fetchall()) == {"a": a, "b": b + 20 + 1024}
    # When it goes down: the deliveries' bytes are taken back, the task's stay
    migrate.downgrade(empty_database, "0022")
    with psycopg.connect(localservices.libpq_url(empty_database), autocommit=True) as conn:
        assert dict(conn.execute(HELD).fetchall()) == {"a": TASK}
        conn.execute(ONE_MORE)  # and nothing counts them any more
        assert dict(conn.execute(HELD).fetchall()) == {"a": TASK}


INVALID_INDEXES = "SELECT indexrelid::regclass::text FROM pg_index WHERE NOT indisvalid"
VERSION = "SELECT version_num FROM alembic_version"


def test_an_index_build_that_gave_up_is_built_again_on_the_next_try(empty_database: str) -> None:
    # Given a database before 0011, which builds an index on tasks concurrently, and a session
    # with a write to tasks in an open transaction, which such a build waits for
    migrate.upgrade(empty_database, "0010")
    with psycopg.connect(localservices.libpq_url(empty_database)) as writer:
        writer.execute(POPULATED.split(";")[0])
        # When the upgrade's tries each give up waiting for it
        with pytest.raises(migrate.MigrationBlocked):
            migrate.upgrade(empty_database, lock_timeout_s=0.2, tries=2, pause_s=0.1)
        writer.rollback()
    # Then the second try was not refused by the index the first left half built (before: it
    # and every try after it failed "already exists" until the index was dropped by hand)
    with psycopg.connect(localservices.libpq_url(empty_database)) as conn:
        left = conn.execute(INVALID_INDEXES).fetchall()
        assert conn.execute(VERSION).fetchone() == ("0010",)
    assert left == [("ix_tasks_tenant_served_finished_at",)]
    # And once the writer is gone the upgrade goes through, every index valid
    migrate.upgrade(empty_database)
    with psycopg.connect(localservices.libpq_url(empty_database)) as conn:
        assert conn.execute(INVALID_INDEXES).fetchall() == []
    assert schema_diff(empty_database) == []


def test_a_downgrade_that_fails_part_way_leaves_the_schema_of_the_version_it_names(
    empty_database: str,
) -> None:
    # Given a task on an instance's queue longer than 0007's column held
    migrate.upgrade(empty_database)
    queue = "echo@agent@1.0.0@" + "i" * 120
    with psycopg.connect(localservices.libpq_url(empty_database), autocommit=True) as conn:
        conn.execute(POPULATED.split(";")[0].replace("'echo', 'echo'", f"'echo', '{queue}'"))
    # When a downgrade to 0007 fails at 0008's narrowing of that column
    with pytest.raises(Exception, match="too long"):
        migrate.downgrade(empty_database, "0007")
    # Then the database is at 0008, and what the migrations after it dropped is recorded as
    # dropped (before: the version stayed at head's with 0011's index gone, and an upgrade
    # then reported success without building it again)
    with psycopg.connect(localservices.libpq_url(empty_database)) as conn:
        assert conn.execute(VERSION).fetchone() == ("0008",)
    migrate.upgrade(empty_database)
    assert schema_diff(empty_database) == []


WRITTEN_BEFORE_0024 = """
INSERT INTO sessions (id, tenant, revision, state, metadata, ttl_s, expires_at)
VALUES ('sess_a', 'a', 3, '{}', '{}', 600, now() + interval '1 hour');
INSERT INTO tasks (id, tenant, capability, queue, status, payload, payload_digest, payload_size,
  trace_id, result_ttl_s, expires_at, session_id, session_turn)
SELECT id::uuid, 'a', 'echo', 'echo', status, '{}', 'd', 2, 't', 60, now() + interval '1 hour',
  'sess_a', turn
FROM (VALUES ('00000000-0000-0000-0000-000000000001', 'running', 1),
             ('00000000-0000-0000-0000-000000000002', 'succeeded', 2),
             ('00000000-0000-0000-0000-000000000003', 'queued', 3)) AS t(id, status, turn);
INSERT INTO session_revisions (session_id, revision, tenant, state, task_id)
VALUES ('sess_a', 2, 'a', '{}', '00000000-0000-0000-0000-000000000001'),
       ('sess_a', 3, 'a', '{}', '00000000-0000-0000-0000-000000000002')
"""
MARKED = "SELECT id::text FROM tasks WHERE session_written_at IS NOT NULL"


def test_0024_marks_the_unfinished_tasks_whose_session_write_is_kept(empty_database: str) -> None:
    """A turn that wrote before the upgrade and is delivered again after it is not run again
    (before it, the claim found its kept revision)."""
    migrate.upgrade(empty_database, "0023")
    with psycopg.connect(localservices.libpq_url(empty_database), autocommit=True) as conn:
        conn.execute(WRITTEN_BEFORE_0024)
    migrate.upgrade(empty_database, "0024")
    with psycopg.connect(localservices.libpq_url(empty_database), autocommit=True) as conn:
        marked = conn.execute(MARKED).fetchall()
    # the running one that wrote, not the finished one that wrote nor the one that did not
    assert marked == [("00000000-0000-0000-0000-000000000001",)]
