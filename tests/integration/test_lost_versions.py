"""A task whose worker was lost comes to what the card it ran under says: idempotent, it runs
again; not, it ends ``worker_lost``. The reaper and the orphan check read a card of the agent
with no version named, any one: a version that is idempotent made another's task run twice."""

from __future__ import annotations

import secrets
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, insert, select, update

from broker.db.models import remote_agents_table, tasks_table
from broker.registry import leases
from broker.registry.model import Card, card_queue
from broker.settings import Settings
from broker.tasks import execution
from tests.integration.rows import a_task_row
from workers.runner import Runner
from workers.sdk.agent import AgentRegistry
from workers.system import recovery


def _advertise(engine: Engine, capability: str, *versions: tuple[str, bool]) -> None:
    """Cards of agent ``pay`` for ``capability``, stored in the order given."""
    for version, idempotent in versions:
        registry = AgentRegistry()
        registry.capability(capability, agent_id="pay", version=version, idempotent=idempotent)(
            lambda ctx, payload: payload
        )
        leases.advertise_cards(engine, [spec.card.document() for spec in registry])


def test_a_lost_task_comes_to_what_the_version_it_ran_under_says(
    settings: Settings, engine: Engine
) -> None:
    # Given agent pay's 1.1.0, idempotent, stored before its 1.0.0, which is not
    capability = f"test.lost-{secrets.token_hex(3)}"
    _advertise(engine, capability, ("1.1.0", True), ("1.0.0", False))
    # and a task running under 1.0.0 on a worker that is gone
    task_id = a_task_row(engine, tenant=f"t-{secrets.token_hex(3)}", capability=capability)
    with engine.begin() as conn:
        conn.execute(
            update(tasks_table)
            .where(tasks_table.c.id == task_id)
            .values(
                status="running",
                attempts=1,
                agent_id="pay",
                agent_version="1.0.0",
                instance="gone@nowhere",
                started_at=datetime.now(UTC) - timedelta(minutes=1),
            )
        )
    runner = Runner(settings, AgentRegistry())
    published: list[Any] = []
    runner.republish = lambda *message: published.append(message)
    # When its loss is recovered
    rows = [r for r in execution.running_tasks(engine, started_before_s=0) if r["id"] == task_id]
    recovery.recover_lost(runner, rows, "its worker is gone")
    # Then it ended worker_lost, not queued to run again
    with engine.connect() as conn:
        status, error = conn.execute(
            select(tasks_table.c.status, tasks_table.c.error).where(tasks_table.c.id == task_id)
        ).one()
    assert (status, error["code"], published) == ("failed", "worker_lost", [])


def test_a_remote_agent_registered_again_without_a_capability_gives_up_its_queue(
    engine: Engine,
) -> None:
    """Registered again at the same version, without the capability: its card's queue was
    taken for still served, and its tasks waited until their TTL."""
    capability, agent_id = f"test.far-{secrets.token_hex(3)}", f"far-{secrets.token_hex(3)}"
    card = Card.declare(capability, agent_id=agent_id, version="1.0.0").document()
    leases.advertise_cards(engine, [{**card, "endpoint": {"protocol": "http"}}])
    other = Card.declare("text.other", agent_id=agent_id, version="1.0.0").document()
    with engine.begin() as conn:
        conn.execute(
            insert(remote_agents_table).values(
                agent_id=agent_id,
                version="1.0.0",
                protocol="http",
                url="http://127.0.0.1:9/far",
                cards=[other],
                secret="s",
            )
        )
    gone = recovery.card_gone(engine, card_queue(capability, agent_id, "1.0.0"))
    assert gone is not None and gone.error is not None
    assert gone.error["code"] == "agent_not_found"
