"""The Agent-Reach stack a run measures: the API (uvicorn, one process) and a worker, both
subprocesses on the run's own Postgres database and Redis db, and the controls the figures need
(keys, making the worker stop consuming a queue, purging it)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
from celery import Celery
from celery.utils.nodenames import host_format

from bench.environment import Stores
from bench.processes import BIN, Child, Children, celery_worker, child_env, free_port, wait_until
from broker.db.engines import sync_engine
from broker.settings import Settings
from broker.tenancy import key_store

WORKER = "bench-reach"
QUEUES = "echo,text.summarize"
RATE_LIMIT_OFF = 10**9


@dataclass
class Stack:
    api: Child
    worker: Child
    port: int
    stores: Stores

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def key(self, tenant: str) -> str:
        """A new API key (allowed everything) for a tenant of its own, one per figure, so each
        figure counts only its own tasks."""
        return self._create_key(tenant, is_admin=False)

    def operator_key(self, tenant: str) -> str:
        """A new operator key: registering remote agents is theirs."""
        return self._create_key(tenant, is_admin=True)

    def _create_key(self, tenant: str, *, is_admin: bool) -> str:
        engine = sync_engine(Settings(database_url=self.stores.database_url), pool_size=1)
        try:
            return key_store.create_key(engine, tenant, ["*"], is_admin=is_admin)[1]
        finally:
            engine.dispose()


@contextmanager
def running_stack(
    stores: Stores,
    children: Children,
    concurrency: int,
    *,
    queues: str = QUEUES,
    pool: str = "prefork",
    **env_values: str,
) -> Iterator[Stack]:
    """The API and one worker (``pool``, ``concurrency``) on ``queues``; ``env_values`` go
    into both processes' environment."""
    env = child_env(
        REACH_DATABASE_URL=stores.database_url,
        REACH_REDIS_URL=stores.redis_url,
        # The per-tenant rate limit and share of a queue are policies, not capacities: lifted
        # so that the figures show what the API can take (the benchmark is one tenant).
        # Everything else runs with its defaults.
        REACH_RATE_LIMIT_PER_S=str(RATE_LIMIT_OFF),
        REACH_RATE_LIMIT_BURST=str(RATE_LIMIT_OFF),
        REACH_REQUEST_RATE_PER_S=str(RATE_LIMIT_OFF),
        REACH_MAX_QUEUE_SHARE="1",
        **env_values,
    )
    port = free_port()
    api = children.start(
        "api",
        [
            str(BIN / "uvicorn"),
            "api.app:create_app_from_env",
            "--factory",
            "--http",
            "api.connections:Protocol",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-access-log",
            "--log-level",
            "warning",
        ],
        env,
    )
    worker = celery_worker(children, WORKER, "workers", queues, concurrency, env, pool)
    stack = Stack(api=api, worker=worker, port=port, stores=stores)
    wait_until(lambda: _healthy(stack.url), timeout_s=60, what="waiting for the API", child=api)
    token = stack.key("bench-warmup")
    with httpx.Client(base_url=stack.url, headers=_auth(token), timeout=30) as http:
        wait_until(
            lambda: _echo_sync(http) == 200,
            timeout_s=60,
            what="waiting for the worker to serve echo",
            child=worker,
        )
        for i in range(4 * min(concurrency, 8)):  # every pool process connected before the clock
            _echo_sync(http, i)
    try:
        yield stack
    finally:
        children.stop(api)
        children.stop(worker)


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _echo_sync(http: httpx.Client, i: int = 0) -> int:
    envelope = {"capability": "echo", "payload": {"i": i}, "reply_mode": "sync"}
    return http.post("/tasks", json=envelope).status_code


def stop_consuming(stack: Stack, queue: str) -> None:
    """The worker stays up and its lease live (so routing works as usual), but stops taking
    ``queue``'s messages: accepted tasks stay queued."""
    control = Celery("bench-control", broker=stack.stores.redis_url, set_as_current=False)
    try:
        node = host_format(f"{WORKER}@%h")
        replies = control.control.cancel_consumer(queue, destination=[node], reply=True, timeout=5)
        if not replies:
            raise RuntimeError(f"{node} did not confirm it stopped consuming {queue}")
    finally:
        control.close()


def purge(stack: Stack, queue: str) -> None:
    control = Celery("bench-control", broker=stack.stores.redis_url, set_as_current=False)
    try:
        with control.connection_for_write() as conn:
            conn.default_channel.queue_purge(queue)
    finally:
        control.close()
