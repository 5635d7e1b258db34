from __future__ import annotations

import secrets
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis
from sqlalchemy import Engine, create_engine, func, select

from api.app import create_app
from broker.db.models import tasks_table
from broker.registry import leases
from broker.settings import Settings
from broker.tenancy import key_store
from reach import localservices, migrate
from tests.integration import remote
from tests.integration.stack import (
    CeleryProcess,
    ServedApp,
    start_beat,
    start_system_workers,
    start_worker,
)
from workers.sdk.agent import AgentRegistry

TEST_QUEUES = ",".join(
    [
        "echo",
        "invoice.extract",
        "text.summarize",
        "test.boom",
        "test.not-json",
        "test.context",
        "test.gen",
        "test.flood",
        "test.flaky",
        "test.flaky-io",
        "test.sleepy",
        "test.stubborn",
        "test.short-fuse",
    ]
)

# Capabilities whose agent no test starts, yet whose tasks must be able to wait in a queue.
# ``test.nobody-fills``, ``test.nobody-shares`` and ``test.nobody-parks``: a test fills each
# one's queue, which no other test may have touched.
DORMANT = (
    "test.nobody",
    "test.nobody-serves",
    "test.nobody-serves-this",
    "test.nobody-fills",
    "test.nobody-shares",
    "test.nobody-holds",
    "test.nobody-parks",
    "test.nobody-first-0",
    "test.nobody-first-1",
)


def advertise_test_cards(engine: Engine) -> None:
    """The cards of every test agent and of the dormant capabilities, in the database of
    ``engine``: only a capability some card has served may be queued for."""
    import tests.agents  # noqa: F401  # registers the test agents with the SDK
    from workers.sdk import agent

    dormant = AgentRegistry()
    for name in DORMANT:
        dormant.capability(name, agent_id="test-dormant")(lambda ctx, payload: None)
    leases.advertise_cards(engine, [s.card.document() for s in [*agent, *dormant]])


@pytest.fixture(scope="session", autouse=True)
def served_cards(engine: Engine) -> None:
    """The test cards in Postgres before any API starts (an API caches which were served)."""
    advertise_test_cards(engine)


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def system_workers(settings: Settings, log_dir: Path) -> Iterator[list[CeleryProcess]]:
    """The maintenance and the webhooks worker, one each, as deployed."""
    processes = start_system_workers(settings, log_dir)
    yield processes
    for process in processes:
        process.stop()


@pytest.fixture(scope="session")
def worker(
    settings: Settings, log_dir: Path, system_workers: list[CeleryProcess]
) -> Iterator[CeleryProcess]:
    """One real Celery worker (prefork, 2 processes) for the capability queues, with the
    system workers running beside it."""
    process = start_worker(settings, TEST_QUEUES, "agents", log_dir)
    yield process
    process.stop()


@pytest.fixture(scope="session")
def system_beat(
    settings: Settings, log_dir: Path, worker: CeleryProcess
) -> Iterator[CeleryProcess]:
    """Celery beat for the whole run: janitor, reaper and sweeper, run by the test worker."""
    process = start_beat(settings, log_dir, name="system-beat")
    yield process
    process.stop()


@pytest.fixture(scope="session")
def api(settings: Settings) -> Iterator[ServedApp]:
    with ServedApp(create_app(settings)) as served:
        yield served


@pytest.fixture(scope="session")
def uncached_api(settings: Settings) -> Iterator[ServedApp]:
    """An API that looks keys up on every request, so a revocation shows at once."""
    with ServedApp(create_app(settings.model_copy(update={"key_cache_s": 0}))) as served:
        yield served


@pytest.fixture
def own_redis(services: localservices.Services) -> Iterator[str]:
    """A Redis db of the test's own, for a stack whose queues must not be shared with the
    session's worker (it would take their messages and find no such task in its database)."""
    url = localservices.claim_redis_db(services.redis_url)
    client = redis.Redis.from_url(url)
    yield url
    client.flushdb()
    client.close()


KeyMaker = Callable[..., tuple[str, str]]


@pytest.fixture
def make_key(engine: Engine) -> KeyMaker:
    """Create a key for a fresh tenant (or the one given); returns (tenant, token)."""

    def make(
        patterns: list[str] | None = None, tenant: str | None = None, *, tenant_admin: bool = False
    ) -> tuple[str, str]:
        tenant = tenant or f"t-{secrets.token_hex(4)}"
        _, token = key_store.create_key(
            engine, tenant, patterns or ["*"], tenant_admin=tenant_admin
        )
        return tenant, token

    return make


def client_for(api: ServedApp, token: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=api.url, headers=headers, timeout=30)


@pytest.fixture
def tenant(make_key: KeyMaker) -> tuple[str, str]:
    return make_key()


@pytest.fixture
def client(
    api: ServedApp, tenant: tuple[str, str], worker: CeleryProcess
) -> Iterator[httpx.Client]:
    """An HTTP client of a fresh tenant allowed everything, with the worker running."""
    with client_for(api, tenant[1]) as http:
        yield http


@pytest.fixture
def tenant_admin(
    api: ServedApp, tenant: tuple[str, str], make_key: KeyMaker
) -> Iterator[httpx.Client]:
    """A tenant-admin client of ``client``'s tenant: it sets the tenant's callback secret."""
    _, token = make_key(tenant=tenant[0], tenant_admin=True)
    with client_for(api, token) as http:
        yield http


def count_tasks(engine: Engine, tenant: str) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                select(func.count()).select_from(tasks_table).where(tasks_table.c.tenant == tenant)
            ).scalar_one()
        )


# -- remote agents (tests/integration/remote.py) ------------------------------------------


@pytest.fixture(scope="module")
def bridge(
    request: pytest.FixtureRequest,
    settings: Settings,
    log_dir: Path,
    system_workers: list[CeleryProcess],
) -> Iterator[CeleryProcess]:
    """A bridge for the test module, its log named after the module."""
    name = request.module.__name__.rsplit(".", 1)[-1]
    process = remote.start_bridge(settings, log_dir / f"bridge-{name}.log")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def ops(api: ServedApp, engine: Engine) -> Iterator[httpx.Client]:
    """An operator's client: registering agents is theirs."""
    _, token = key_store.create_key(engine, f"ops-{uuid.uuid4().hex[:8]}", ["*"], is_admin=True)
    with client_for(api, token) as http:
        yield http


@pytest.fixture(scope="module")
def caller(api: ServedApp, engine: Engine) -> Iterator[httpx.Client]:
    """A tenant's client, allowed every capability."""
    _, token = key_store.create_key(engine, f"t-{uuid.uuid4().hex[:8]}", ["*"])
    with client_for(api, token) as http:
        yield http


@pytest.fixture
def own_engine(services: localservices.Services) -> Iterator[Engine]:
    """A migrated database of the test's own: no sweeper of the session's stack takes or
    expires its rows, and its plans see only what the test put there."""
    name = f"reach_own_{secrets.token_hex(4)}"
    url = localservices.create_database(services.database_url, name)
    migrate.upgrade(url)
    built = create_engine(url)
    yield built
    built.dispose()
    localservices.drop_database(services.database_url, name)
