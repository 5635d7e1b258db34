"""More than one API process: two ``reach api`` processes (and one ``reach api --workers 2``)
and two worker nodes (``-n a@%h``, ``-n b@%h``) on one Postgres database and one Redis db.

Nothing is lost or run twice whichever API accepts a task and whichever node takes it, an
idempotency key gives the same task through either API, and a stream or a sync wait is
answered by whichever API process holds the connection: the events go through Redis. Each
process of ``--workers 2`` answers ``/metrics`` for both."""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import signal
import subprocess
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import httpx
import psutil
import pytest
import redis
from celery.utils.nodenames import host_format
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr
from sqlalchemy import Engine, select

from broker.db.models import tasks_table
from broker.observability import metrics_dirs
from broker.settings import Settings
from tests.eventually import eventually
from tests.integration.conftest import KeyMaker, count_tasks
from tests.integration.stack import BIN, ROOT, CeleryProcess, environment, free_port, start_worker
from tests.integration.test_replies import frames, read_stream

FINAL = {"succeeded", "failed", "cancelled", "expired"}
# No session-scoped worker consumes this queue: nodes a and b below are its only consumers.
# Its handler counts its runs in Redis (reach:test:runs:<task id>) and is not idempotent, so a
# redelivery would show as a second run.
CAPABILITY = "test.slow-once"
NODES = ("a", "b")


METRICS_TOKEN = "scrape-" + "5d2a" * 8


class ApiProcess:
    """``reach api``: an API in OS processes of its own, configured by the environment the
    settings make, its output in a log file."""

    def __init__(self, settings: Settings, log_path: Path, workers: int = 1) -> None:
        self.settings = settings
        self.log_path = log_path
        self.workers = workers
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._children: list[psutil.Process] = []

    def start(self, timeout_s: float = 90) -> ApiProcess:
        argv = [str(BIN / "reach"), "api", "--host", "127.0.0.1", "--port", str(self.port)]
        if self.workers > 1:
            argv += ["--workers", str(self.workers)]
        # Its metrics folder is its own to choose, never one this test process was given.
        env = {k: v for k, v in environment(self.settings).items() if k != metrics_dirs.ENV}
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            argv,
            env=env,
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        process = self.process
        with contextlib.suppress(AssertionError):  # a hang is reported below, with the log
            eventually(
                lambda: self.ready() or process.poll() is not None,
                f"uvicorn on {self.port} to answer /readyz or exit",
                timeout_s,
                0.2,
            )
        if not self.ready():
            self.stop()
            raise RuntimeError(f"uvicorn on {self.port} did not start:\n{self.output()}")
        if self.workers > 1:
            self._children = eventually(
                self.worker_processes,
                f"{self.workers} uvicorn worker processes",
                timeout_s,
                0.2,
                until=lambda found: len(found) == self.workers,
            )
        return self

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def worker_processes(self) -> list[psutil.Process]:
        """The processes ``--workers`` spawned (multiprocessing's helpers are not serving)."""
        children = psutil.Process(self.pid).children()
        return [c for c in children if "resource_tracker" not in " ".join(c.cmdline())]

    def serving(self, client_port: int) -> int | None:
        """The pid of the worker process holding the connection from ``client_port``."""
        for child in self._children:
            for conn in child.net_connections(kind="tcp"):
                if (
                    conn.status == psutil.CONN_ESTABLISHED
                    and conn.raddr
                    and (conn.laddr.port, conn.raddr.port) == (self.port, client_port)
                ):
                    return child.pid
        return None

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 30) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for child in self._children:  # only if the supervisor left one behind
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        if self._log is not None:
            self._log.close()


@pytest.fixture(scope="module")
def nodes(settings: Settings, log_dir: Path) -> Iterator[list[CeleryProcess]]:
    """Two worker nodes, a@%h and b@%h, on the same queue, before any API starts."""
    started: list[CeleryProcess] = []
    try:
        for name in NODES:
            started.append(start_worker(settings, CAPABILITY, name, log_dir))
        yield started
    finally:
        for process in started:
            process.stop()


@pytest.fixture(scope="module")
def apis(
    settings: Settings, log_dir: Path, nodes: list[CeleryProcess]
) -> Iterator[tuple[ApiProcess, ApiProcess]]:
    """Two API processes, each a ``uvicorn`` of its own on its own port."""
    started: list[ApiProcess] = []
    try:
        for i in (1, 2):
            started.append(ApiProcess(settings, log_dir / f"api-{i}.log").start())
        yield started[0], started[1]
    finally:
        for api in started:
            api.stop()


@pytest.fixture(scope="module")
def multi_api(
    settings: Settings, log_dir: Path, nodes: list[CeleryProcess]
) -> Iterator[ApiProcess]:
    """``reach api --workers 2``: two API processes behind one port."""
    api = ApiProcess(settings, log_dir / "api-workers-2.log", workers=2).start()
    yield api
    api.stop()


def node_names() -> set[str]:
    return {host_format(f"{name}@%h") for name in NODES}


def statuses_of(engine: Engine, ids: list[str]) -> dict[str, tuple[str, int, str | None]]:
    """(status, attempts, instance) of each task, straight from Postgres."""
    query = select(
        tasks_table.c.id, tasks_table.c.status, tasks_table.c.attempts, tasks_table.c.instance
    ).where(tasks_table.c.id.in_([uuid.UUID(i) for i in ids]))
    with engine.connect() as conn:
        return {str(r.id): (r.status, r.attempts, r.instance) for r in conn.execute(query)}


def runs_of(redis_url: str, ids: list[str]) -> dict[str, int]:
    client = redis.Redis.from_url(redis_url)
    try:
        counts = client.mget([f"reach:test:runs:{i}" for i in ids])
    finally:
        client.close()
    return {i: int(n or 0) for i, n in zip(ids, counts, strict=True)}


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def requests_counted(text: str, labels: dict[str, str]) -> float:
    """``reach_http_requests_total`` with these labels in a scrape (0 when absent)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "reach_http_requests_total" and sample.labels == labels:
                return sample.value
    return 0.0


def client_port(response: httpx.Response) -> int:
    """The local port of the connection that carried ``response``."""
    stream = response.extensions["network_stream"]
    port: int = stream.get_extra_info("client_addr")[1]
    return port


@pytest.mark.timeout(240)
def test_tasks_submitted_through_both_apis_run_once_each_on_either_node(
    apis: tuple[ApiProcess, ApiProcess], make_key: KeyMaker, engine: Engine, redis_url: str
) -> None:
    tenant, token = make_key()
    # Given 300 envelopes sent alternately to API 1 and API 2, and five idempotency keys each
    # sent twice to each API, all at once in a shuffled order
    plain = [
        (i % 2, {"capability": CAPABILITY, "payload": {"i": i, "sleep_s": 0.01}}, None)
        for i in range(300)
    ]
    keyed = [
        (j % 2, {"capability": CAPABILITY, "payload": {"k": k, "sleep_s": 0.01}}, f"dup-{k}")
        for k in range(5)
        for j in range(4)
    ]
    requests = plain + keyed
    random.Random(14).shuffle(requests)

    async def submit_all() -> list[httpx.Response]:
        gate = asyncio.Semaphore(16)  # the APIs' Postgres pools are shared with other runs
        async with (
            httpx.AsyncClient(base_url=apis[0].url, headers=auth(token), timeout=60) as one,
            httpx.AsyncClient(base_url=apis[1].url, headers=auth(token), timeout=60) as two,
        ):

            async def post(api: int, body: dict[str, Any], key: str | None) -> httpx.Response:
                headers = {"Idempotency-Key": key} if key else {}
                async with gate:
                    return await (one, two)[api].post("/tasks", json=body, headers=headers)

            return await asyncio.gather(*(post(*r) for r in requests))

    # When they are submitted
    responses = asyncio.run(submit_all())
    assert [r.status_code for r in responses if r.status_code != 202] == []
    accepted_by: dict[str, int] = {}
    by_key: dict[str, list[httpx.Response]] = {}
    for (api, _, key), response in zip(requests, responses, strict=True):
        accepted_by.setdefault(response.json()["task_id"], api)
        if key:
            by_key.setdefault(key, []).append(response)
    # Then one key is one task, whichever API was asked, created once and replayed thrice
    for key, answers in by_key.items():
        assert len({r.json()["task_id"] for r in answers}) == 1, key
        assert sum("idempotent-replayed" not in r.headers for r in answers) == 1, key
    ids = list(accepted_by)
    assert len(ids) == 305
    assert count_tasks(engine, tenant) == 305
    # and every task succeeds on its first attempt, run exactly once, by node a or node b
    rows = eventually(
        lambda: statuses_of(engine, ids),
        "every task final",
        180,
        0.5,
        until=lambda found: len(found) == 305 and all(s in FINAL for s, _, _ in found.values()),
    )
    assert {t: s for t, (s, _, _) in rows.items() if s != "succeeded"} == {}
    assert {t: n for t, (_, n, _) in rows.items() if n != 1} == {}
    assert {t: n for t, n in runs_of(redis_url, ids).items() if n != 1} == {}
    ran_on = Counter(instance for _, _, instance in rows.values())
    assert set(ran_on) == node_names(), ran_on  # each node ran some, nobody else any
    # and the API that did not accept a task shows it as the other one does
    with (
        httpx.Client(base_url=apis[0].url, headers=auth(token), timeout=30) as one,
        httpx.Client(base_url=apis[1].url, headers=auth(token), timeout=30) as two,
    ):
        for task_id, api in accepted_by.items():
            task = (two, one)[api].get(f"/tasks/{task_id}").json()
            assert (task["task_id"], task["status"]) == (task_id, "succeeded")
            assert task["result"] == {"runs": 1}
            assert task["agent"]["instance"] == rows[task_id][2]


@pytest.mark.timeout(120)
def test_streams_and_sync_waits_are_answered_by_whichever_api_holds_them(
    apis: tuple[ApiProcess, ApiProcess], make_key: KeyMaker, redis_url: str
) -> None:
    _, token = make_key()
    key = f"held-{uuid.uuid4()}"
    body = {"capability": CAPABILITY, "payload": {"sleep_s": 2}}

    async def scenario() -> dict[str, Any]:
        async with (
            httpx.AsyncClient(base_url=apis[0].url, headers=auth(token), timeout=60) as one,
            httpx.AsyncClient(base_url=apis[1].url, headers=auth(token), timeout=60) as two,
        ):
            # Given a task that runs for two seconds, accepted by API 1
            first = await one.post("/tasks", json=body, headers={"Idempotency-Key": key})
            assert first.status_code == 202, first.text
            task_id = first.json()["task_id"]

            async def stream(
                http: httpx.AsyncClient, method: str, url: str, **kwargs: Any
            ) -> tuple[str, list[dict[str, object]]]:
                async with http.stream(method, url, **kwargs) as response:
                    assert response.status_code == 200, await response.aread()
                    # the task as API 1 has it while this stream is open
                    status = (await one.get(f"/tasks/{task_id}")).json()["status"]
                    lines = [line async for line in response.aiter_lines()]
                return status, [f for f in frames(iter(lines)) if "comment" not in f]

            async def sync(http: httpx.AsyncClient, json: dict[str, Any], **kw: Any) -> Any:
                return await http.post("/tasks", json={**json, "reply_mode": "sync"}, **kw)

            # When, all at once, API 2 streams its events and holds a sync wait for it (the
            # same key), API 1 streams it again (the same key), and each API holds a sync wait
            # for a task of its own
            own = {"capability": CAPABILITY, "payload": {"sleep_s": 0.5}}
            (
                (status_at_get, on_two),
                (status_at_post, on_one),
                sync_on_two,
                own_on_one,
                own_on_two,
            ) = await asyncio.gather(
                stream(two, "GET", f"/tasks/{task_id}/events"),
                stream(
                    one,
                    "POST",
                    "/tasks",
                    json={**body, "reply_mode": "stream"},
                    headers={"Idempotency-Key": key},
                ),
                sync(two, body, headers={"Idempotency-Key": key}),
                sync(one, own),
                sync(two, own),
            )
            return {
                "task_id": task_id,
                "status_at_get": status_at_get,
                "status_at_post": status_at_post,
                "on_two": on_two,
                "on_one": on_one,
                "sync_on_two": sync_on_two,
                "own": (own_on_one, own_on_two),
            }

    seen = asyncio.run(scenario())
    task_id = seen["task_id"]
    # Then both streams were opened while the task was unfinished, so what followed came live
    assert seen["status_at_get"] in ("queued", "running")
    assert seen["status_at_post"] in ("queued", "running")
    # and each carries every event in order, through the final one
    on_two: list[dict[str, Any]] = seen["on_two"]
    assert [int(e["id"]) for e in on_two] == list(range(1, len(on_two) + 1))
    assert [e["event"] for e in on_two] == ["status", "status", "succeeded"]
    assert [e["data"]["data"]["status"] for e in on_two[:2]] == ["queued", "running"]
    assert [(e["id"], e["data"]) for e in seen["on_one"]] == [(e["id"], e["data"]) for e in on_two]
    # and API 2's sync wait for the task API 1 accepted was answered with it, final
    sync_on_two: httpx.Response = seen["sync_on_two"]
    assert sync_on_two.status_code == 200, sync_on_two.text
    assert sync_on_two.headers["idempotent-replayed"] == "true"
    final = sync_on_two.json()
    assert (final["task_id"], final["status"]) == (task_id, "succeeded")
    assert on_two[-1]["data"]["data"] == final
    # and it ran once, for four requests on two APIs
    assert final["result"] == {"runs": 1}
    assert runs_of(redis_url, [task_id]) == {task_id: 1}
    # and each API answered the sync wait it held, with the task finished
    for answer in seen["own"]:
        assert answer.status_code == 200, answer.text
        assert answer.json()["status"] == "succeeded"
        assert answer.json()["result"] == {"runs": 1}


def test_a_task_accepted_by_one_api_is_visible_at_once_on_the_other(
    apis: tuple[ApiProcess, ApiProcess], make_key: KeyMaker
) -> None:
    _, token = make_key()
    with (
        httpx.Client(base_url=apis[0].url, headers=auth(token), timeout=30) as one,
        httpx.Client(base_url=apis[1].url, headers=auth(token), timeout=30) as two,
    ):
        for accepting, other in ((one, two), (two, one)):
            # Given a task just accepted by one API
            accepted = accepting.post("/tasks", json={"capability": CAPABILITY, "payload": {}})
            assert accepted.status_code == 202, accepted.text
            task_id = accepted.json()["task_id"]
            # When the other API is asked for it at once, and for the tenant's tasks
            shown = other.get(f"/tasks/{task_id}")
            listed = other.get("/tasks", params={"capability": CAPABILITY}).json()["tasks"]
            # Then it has the same task
            assert shown.status_code == 200, shown.text
            # (Not its expires_at: a worker's claim may have moved it on meanwhile, to hold
            # the row for as long as the run may last.)
            same = ("task_id", "capability", "trace_id", "created_at")
            assert {k: shown.json()[k] for k in same} == {k: accepted.json()[k] for k in same}
            assert task_id in [t["task_id"] for t in listed]
            # and sees it finish
            done = eventually(
                lambda: other.get(f"/tasks/{task_id}").json(),  # noqa: B023
                f"task {task_id} final",
                until=lambda task: task["status"] in FINAL,
            )
            assert done["status"] == "succeeded"


@pytest.mark.timeout(180)
def test_each_process_of_reach_api_workers_2_answers_streams_and_sync_waits(
    apis: tuple[ApiProcess, ApiProcess], multi_api: ApiProcess, make_key: KeyMaker
) -> None:
    _, token = make_key()
    children = {p.pid for p in multi_api.worker_processes()}
    assert len(children) == 2, children
    served: dict[int, list[tuple[str, str]]] = {}
    with httpx.Client(base_url=apis[0].url, headers=auth(token), timeout=30) as one:
        for _ in range(60):  # the kernel picks which process accepts each connection
            if set(served) == children:
                break
            # Given a task accepted by API 1, still running
            body = {"capability": CAPABILITY, "payload": {"sleep_s": 0.3}}
            task_id = one.post("/tasks", json=body).json()["task_id"]
            # and one connection to the --workers 2 API, held by one of its processes
            limits = httpx.Limits(max_connections=1)
            with httpx.Client(
                base_url=multi_api.url, headers=auth(token), timeout=30, limits=limits
            ) as http:
                port = client_port(http.get("/healthz"))
                pid = multi_api.serving(port)
                assert pid in children, (pid, children)
                if pid in served:
                    continue
                # When that process streams the task's events and holds a sync wait
                events = read_stream(http, "GET", f"/tasks/{task_id}/events")
                own = http.post("/tasks", json={**body, "reply_mode": "sync"})
                assert client_port(own) == port  # the same connection, the same process
            # Then it answers both with the final state
            assert events[-1]["event"] == "succeeded", events
            assert events[-1]["data"]["data"]["task_id"] == task_id
            assert own.status_code == 200, own.text
            assert own.json()["status"] == "succeeded"
            served[pid] = [(task_id, "stream"), (own.json()["task_id"], "sync")]
    assert set(served) == children, f"only {sorted(served)} of {sorted(children)} answered"


@pytest.mark.timeout(180)
def test_each_process_of_reach_api_workers_2_counts_for_both_in_metrics(
    settings: Settings, log_dir: Path, make_key: KeyMaker
) -> None:
    scraped_settings = settings.model_copy(update={"metrics_token": SecretStr(METRICS_TOKEN)})
    multi_api = ApiProcess(scraped_settings, log_dir / "api-metrics.log", workers=2).start()
    try:
        folder = counted_by_both(multi_api, make_key)
    finally:
        multi_api.stop()
    # and the folder they counted in goes with them
    assert not folder.exists(), sorted(folder.iterdir())


def counted_by_both(multi_api: ApiProcess, make_key: KeyMaker) -> Path:
    """Lookups answered by each process, counted by each; the processes' metrics folder."""
    _, token = make_key()
    children = {p.pid for p in multi_api.worker_processes()}
    # (a folder of their own, named in their environment by the process that spawned them)
    folders = {Path(p.environ()[metrics_dirs.ENV]) for p in multi_api.worker_processes()}
    assert len(folders) == 1 and next(iter(folders)).is_dir(), folders
    looked_up = {"method": "GET", "route": "/tasks/{task_id}", "status": "404"}
    scrape_headers = auth(METRICS_TOKEN)
    limits = httpx.Limits(max_connections=1)

    def one_connection() -> httpx.Client:
        return httpx.Client(base_url=multi_api.url, timeout=30, limits=limits)

    with one_connection() as http:
        before = requests_counted(http.get("/metrics", headers=scrape_headers).text, looked_up)
    # Given tasks looked up on new connections until each process has answered two
    answered: Counter[int] = Counter()
    for _ in range(200):  # the kernel picks which process accepts each connection
        if len(answered) == 2 and min(answered.values()) >= 2:
            break
        with one_connection() as http:
            response = http.get(f"/tasks/{uuid.uuid4()}", headers=auth(token))
            assert response.status_code == 404, response.text
            pid = multi_api.serving(client_port(response))
            assert pid in children, (pid, children)
            answered[pid] += 1
    assert set(answered) == children, answered
    asked = sum(answered.values())
    # When /metrics is scraped on new connections until each process has answered one
    scraped: dict[int, str] = {}
    for _ in range(200):
        if set(scraped) == children:
            break
        with one_connection() as http:
            response = http.get("/metrics", headers=scrape_headers)
            assert response.status_code == 200, response.text
            scraped.setdefault(multi_api.serving(client_port(response)) or 0, response.text)
    assert set(scraped) == children, sorted(scraped)
    # Then each process counts the lookups both answered
    counted = {pid: requests_counted(text, looked_up) for pid, text in scraped.items()}
    assert counted == {pid: before + asked for pid in children}, (before, answered)
    # and gives the system gauges, computed by both, once: the freshest, no pid label
    for text in scraped.values():
        refreshed = re.findall(
            r"^reach_system_gauges_refreshed_timestamp_seconds(\S*) (\S+)$", text, re.M
        )
        assert len(refreshed) == 1 and refreshed[0][0] == "", refreshed
        assert float(refreshed[0][1]) > 0
    return next(iter(folders))
