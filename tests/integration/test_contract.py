"""The OpenAPI document is the contract: schemathesis, with every check, against a live stack
finds nothing; and a client generated from the document by openapi-python-client submits a
task and reads it back.

The operator's routes (registering, draining, revoking, channels) and the operator's view of
agents and capabilities are run again with an operator key, against an API of a database and
Redis of their own: what it registers, drains or revokes never reaches the session's agents.

The protocol facades are left out of schemathesis: the A2A routes (``/a2a/*`` and the agent
card) are a2a-sdk's, and ``POST /mcp`` hands the request to the MCP SDK's transport; both
answer by their own protocol's rules (JSON-RPC errors, the MCP transport's Accept and
Content-Type rules), which their documents do not state and we do not own. Every other
route is covered.
"""

from __future__ import annotations

import importlib
import re
import secrets
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from pydantic import SecretStr

from api.app import create_app
from broker.db.engines import sync_engine
from broker.settings import Settings
from broker.tenancy import key_store
from reach import localservices, migrate
from tests.eventually import eventually
from tests.integration.conftest import KeyMaker, advertise_test_cards
from tests.integration.stack import BIN, CeleryProcess, ServedApp

FACADES = r"^/(a2a/|\.well-known/|mcp$)"
# What an operator's key does or sees differently: every other route answers it as any key.
OPERATED = r"^/(agents|capabilities)"
EXAMPLES_PER_OPERATION = 25
METRICS_TOKEN = SecretStr("contract-metrics-token")
RUN_LIMIT_S = 600  # bounds a hang only; the run takes about three minutes


def _quick(settings: Settings, **update: Any) -> Settings:
    """Settings whose sync and MCP waits are short: a generated sync submit of a task no agent
    takes waits at most a second, not thirty."""
    waits = {"sync_max_wait_s": 1, "mcp_wait_s": 1, "metrics_token": METRICS_TOKEN}
    return settings.model_copy(update={**waits, **update})


@pytest.fixture(scope="module")
def contract_api(settings: Settings) -> Iterator[ServedApp]:
    with ServedApp(create_app(_quick(settings))) as served:
        yield served


@pytest.fixture(scope="module")
def operator_api(
    services: localservices.Services, settings: Settings
) -> Iterator[tuple[ServedApp, str]]:
    """An API on a database and a Redis db of its own, holding the test agents' cards, and an
    operator's key to it: the generated registrations, drains and revocations stay there."""
    name = f"reach_contract_{secrets.token_hex(3)}"
    database_url = localservices.create_database(services.database_url, name)
    redis_url = localservices.claim_redis_db(services.redis_url)
    try:
        migrate.upgrade(database_url)
        own = _quick(settings, database_url=database_url, redis_url=redis_url)
        engine = sync_engine(own)
        try:
            advertise_test_cards(engine)
            _, token = key_store.create_key(engine, "ops-contract", ["*"], is_admin=True)
        finally:
            engine.dispose()
        with ServedApp(create_app(own)) as served:
            yield served, token
    finally:
        with redis.Redis.from_url(redis_url) as client:
            client.flushdb()
        localservices.drop_database(services.database_url, name)


# Answers the document states that the generated data cannot avoid, per operation. Each is
# a refusal of a request valid by its schema on grounds no schema can state: what exists.
CONFIG = f"""
[generation]
# Stated in the document's description (a body is refused 400 invalid_string).
allow-x00 = false

[checks.missing_required_header]
# If-Match is required on session writes; without it the answer is 428 (RFC 6585).
expected-statuses = ["400", "401", "403", "406", "415", "422", "428"]

[[operations]]
include-path = "/metrics"
headers = {{ Authorization = "Bearer {METRICS_TOKEN.get_secret_value()}" }}

[[operations]]
# By operation id: a path and a method in one block select either (schemathesis ORs them),
# and so applied these to every POST and to GET /tasks.
include-operation-id = "submit_task"
# 503 no_agent_available: no live agent serves a generated capability name.
checks.not_a_server_error.expected-statuses = ["2xx", "3xx", "4xx", "503"]
# 422: a session_id that names no live session, a callback URL that does not resolve to an
# allowed address, a payload the serving card's input schema refuses; 410: a revoked
# version as the target.
checks.positive_data_acceptance.expected-statuses = [
    "2xx", "3xx", "401", "403", "404", "409", "410", "422", "429", "5xx",
]

[[operations]]
include-operation-id = "create_webhook"
# 422 url_not_allowed: a URL that does not resolve to an allowed address.
checks.positive_data_acceptance.expected-statuses = [
    "2xx", "3xx", "401", "403", "404", "409", "422", "429", "5xx",
]

[[operations]]
include-operation-id = ["replace_session", "patch_session"]
# 412 revision_conflict: an If-Match that is not the session's current revision.
checks.positive_data_acceptance.expected-statuses = [
    "2xx", "3xx", "401", "403", "404", "409", "412", "429", "5xx",
]
"""

# The operator's pass: its writes refused on what exists, which no schema can state.
OPERATOR_CONFIG = """
[generation]
allow-x00 = false

[[operations]]
include-operation-id = ["register_agent", "put_channel"]
# 422: a registration's endpoint outside the allowed networks or an A2A card that cannot be
# read; channel weights of versions the agent does not have (channel_invalid).
checks.positive_data_acceptance.expected-statuses = [
    "2xx", "3xx", "401", "403", "404", "422", "429", "5xx",
]
"""


@pytest.mark.timeout(RUN_LIMIT_S + 60)
def test_schemathesis_finds_nothing_with_every_check(
    contract_api: ServedApp, make_key: KeyMaker, worker: CeleryProcess, tmp_path: Path
) -> None:
    # Given a live stack and a tenant-admin key of a fresh tenant (not an operator's: the
    # generated requests must not drain or revoke the session's own test agents)
    _, token = make_key(tenant_admin=True)
    # When schemathesis runs every check on every operation but the facades. One worker: its
    # workers are threads, and hypothesis describes its filters with ``ast.parse``, which on
    # Python 3.11 now and then fails in a threaded process with "SystemError: AST constructor
    # recursion depth mismatch" (CPython gh-106905), failing this run with nothing wrong in
    # the API. One worker takes about two minutes here.
    run = _schemathesis(
        contract_api, token, tmp_path, CONFIG, "--workers", "1", "--exclude-path-regex", FACADES
    )
    # Then it passes clean
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-5000:]


@pytest.mark.timeout(RUN_LIMIT_S + 60)
def test_schemathesis_finds_nothing_in_what_an_operator_does_and_sees(
    operator_api: tuple[ServedApp, str], tmp_path: Path
) -> None:
    # Given an API of its own and an operator's key (agents registered, no instance live)
    served, token = operator_api
    # When schemathesis runs every check on the agents' and capabilities' operations
    # (one worker: ten operations, and no two threads in hypothesis's ast.parse on 3.11)
    run = _schemathesis(
        served, token, tmp_path, OPERATOR_CONFIG, "--workers", "1", "--include-path-regex", OPERATED
    )
    # Then the operator's answers (registrations, revocations, instance names, each card's
    # tenants, queue depths) are as the document says
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-5000:]


def _schemathesis(
    served: ServedApp, token: str, folder: Path, config_text: str, *selection: str
) -> subprocess.CompletedProcess[str]:
    """Schemathesis with every check and phase on the operations ``selection`` picks."""
    config = folder / "schemathesis.toml"
    config.write_text(textwrap.dedent(config_text))
    return subprocess.run(
        [
            str(BIN / "schemathesis"),
            "--config-file",
            str(config),
            "run",
            f"{served.url}/openapi.json",
            "--checks",
            "all",
            "--phases",
            "examples,coverage,fuzzing,stateful",
            "--max-examples",
            str(EXAMPLES_PER_OPERATION),
            *selection,
            "--header",
            f"Authorization: Bearer {token}",
            "--seed",
            "18",
            "--request-timeout",
            "30",
            "--no-color",
        ],
        capture_output=True,
        text=True,
        timeout=RUN_LIMIT_S,
        cwd=folder,
    )


def test_a_generated_client_submits_and_reads_a_task(
    api: ServedApp, make_key: KeyMaker, worker: CeleryProcess, tmp_path: Path
) -> None:
    # Given a client generated from the live document
    _, token = make_key()
    generated = subprocess.run(
        [
            str(BIN / "openapi-python-client"),
            "generate",
            "--url",
            f"{api.url}/openapi.json",
            "--output-path",
            str(tmp_path / "reach_generated"),
            "--meta",
            "none",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert generated.returncode == 0, generated.stdout + generated.stderr
    # (every operation generated, a2a-sdk's `/a2a/rest/tasks/{id}` ones too: none skipped
    # for a path template whose parameters the document does not declare)
    said = generated.stdout + generated.stderr
    assert re.findall(r"WARNING parsing \S+ \S+", said) == [], said
    assert "Incorrect path templating" not in said, said
    package = _import_generated(tmp_path / "reach_generated")
    # When it submits an echo task and polls it
    client = package.AuthenticatedClient(base_url=api.url, token=token)
    with client:
        submitted = _operation(package, "submit_task").sync_detailed(
            client=client,
            body=_model(package, "Envelope").from_dict({"capability": "echo", "payload": {"a": 1}}),
        )
        assert submitted.status_code == 202, submitted.content
        task_id = submitted.parsed.task_id

        def read() -> Any:
            return _operation(package, "get_task").sync(task_id=task_id, client=client)

        task = eventually(
            read, f"task {task_id} final", 30, until=lambda t: t.status not in ("queued", "running")
        )
    # Then it reads back the succeeded task with the echoed payload
    assert task.status == "succeeded"
    assert task.capability == "echo"
    assert task.result == {"a": 1}


def _import_generated(folder: Path) -> Any:
    """The generated package (with ``--meta none`` the folder is the package itself)."""
    sys.path.insert(0, str(folder.parent))
    try:
        return importlib.import_module(folder.name)
    finally:
        sys.path.remove(str(folder.parent))


def _operation(package: Any, name: str) -> Any:
    """The generated module of a ``tasks`` operation (modules are grouped by tag)."""
    return importlib.import_module(f"{package.__name__}.api.tasks.{name}")


def _model(package: Any, name: str) -> Any:
    return getattr(importlib.import_module(f"{package.__name__}.models"), name)


def test_a_405_names_every_method_of_the_path(api: ServedApp) -> None:
    # Given a path served by two routes (GET and POST /tasks), when asked with another method
    answer = httpx.delete(f"{api.url}/tasks")
    # Then the Allow header names both, not only the first route's
    assert answer.status_code == 405
    assert set(answer.headers["allow"].split(", ")) == {"GET", "POST"}
    assert answer.headers["content-type"] == "application/problem+json"


def test_a_last_event_id_of_non_ascii_digits_is_a_400(
    api: ServedApp, make_key: KeyMaker, worker: CeleryProcess
) -> None:
    # Given a task, when its stream is opened with Last-Event-ID "²" (a digit to str.isdigit)
    _, token = make_key()
    auth = {"Authorization": f"Bearer {token}"}
    task = httpx.post(
        f"{api.url}/tasks", json={"capability": "echo", "payload": {}}, headers=auth
    ).json()
    answer = httpx.get(
        f"{api.url}/tasks/{task['task_id']}/events",
        headers=[*auth.items(), ("Last-Event-ID", b"\xb2")],  # type: ignore[list-item]
    )
    # Then it is refused as the document says, not a 500
    assert answer.status_code == 400
    assert answer.json()["code"] == "invalid_last_event_id"
