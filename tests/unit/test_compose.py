"""docker-compose.yml and the Dockerfile, checked without a Docker engine.

There is no Docker engine where these tests run, so the compose file has to be right by
construction. These tests read it (and the Dockerfile) as data and check it against the project:
the Dockerfile exists and copies files that exist, the shared environment is made of
``broker.settings.Settings`` fields, every command names a console script / module / attribute /
package that exists, there is one worker per declared example capability, each internal queue
has a worker of its own, only the API and (on loopback, behind a password) Flower are
published, and the start-up order and health checks are what the contract says. The files
are read by ``compose_file``, next to this.
"""

from __future__ import annotations

import inspect
import re
import shlex
import tomllib
from urllib.parse import urlsplit

import pytest
from reach_client.cli import parser as cli_parser

from broker.db.engines import async_engine, sync_engine
from broker.settings import Settings
from reach import cli as reach_cli
from tests import compose_file as compose
from tests.compose_file import COMPOSE_FILE, ROOT
from workers.runner import THREADED_DB_POOL

# The example capabilities, one worker service each (the contract).
CAPABILITIES = {"echo", "invoice.extract", "text.summarize", "chat.reply", "llm.complete"}
# Async agents: their worker runs on the threads pool with this many at once.
ASYNC_CAPABILITIES = {"llm.complete": "500"}
# The internal queues, each consumed by a worker of its own (service: queue).
SYSTEM_WORKERS = {"worker-maintenance": "reach.maintenance", "worker-webhooks": "reach.webhooks"}
SYSTEM_QUEUES = set(SYSTEM_WORKERS.values())
BRIDGE_APP = "workers.bridge"
SHARED_ENV_KEY = "x-reach-env"


# ---------------------------------------------------------------------------------------------
# The helpers can fail: they are what the checks below stand on
# ---------------------------------------------------------------------------------------------


def test_top_level_definition_finder_tells_defined_from_undefined() -> None:
    # given a module with a function, an assignment and an import
    source = "import os\nfrom x import y as z\ndef f(): pass\napp = 1\nif True:\n    hidden = 2\n"
    # when / expect each top-level name is found, and nothing else
    for name in ("os", "z", "f", "app"):
        assert compose.defines_top_level(source, name), name
    for name in ("y", "hidden", "g"):
        assert not compose.defines_top_level(source, name), name


def test_capability_scanner_reads_decorator_names_only() -> None:
    # given an example module with two capability decorators and an unrelated call
    source = (
        "from workers.sdk import Agent\n"
        "agent = Agent('demo')\n"
        "@agent.capability('echo', version='1')\n"
        "def echo(p): return p\n"
        "@agent.capability(name='text.summarize')\n"
        "def summarize(p): return p\n"
        "print('invoice.extract')\n"
    )
    # when it is scanned
    found = compose.declared_capabilities(source)
    # expect exactly the decorated names
    assert found == {"echo", "text.summarize"}


def test_port_and_duration_parsers_read_compose_syntax() -> None:
    # given the port and duration spellings compose accepts
    service = {"ports": ["8000:8000", "127.0.0.1:5555:5555/tcp", {"target": 1, "published": 2}]}
    # when / expect they parse to (host, container) pairs and seconds
    assert compose.published_container_ports(service) == {(8000, 8000), (5555, 5555), (2, 1)}
    assert compose.published(service) == {
        ("0.0.0.0", 8000, 8000),
        ("127.0.0.1", 5555, 5555),
        ("0.0.0.0", 2, 1),
    }
    assert compose.published({"ports": ["9808", "[::1]:80:8080"]}) == {
        ("0.0.0.0", 0, 9808),
        ("::1", 80, 8080),
    }
    assert compose.duration_s("60s") == 60
    assert compose.duration_s("1m30s") == 90
    with pytest.raises(ValueError):
        compose.duration_s("sixty")


def test_interpolation_default_reads_only_a_whole_variable_with_a_default() -> None:
    # given the spellings compose substitutes, and some it does not or that have no default
    # when / expect the variable and its default, or None
    assert compose.interpolation_default("${API_WORKERS:-2}") == ("API_WORKERS", "2")
    assert compose.interpolation_default(" ${A_B-x} ") == ("A_B", "x")
    for value in ("2", "${API_WORKERS}", "${API_WORKERS:?set it}", "x${A:-1}", "$A"):
        assert compose.interpolation_default(value) is None, value


# ---------------------------------------------------------------------------------------------
# (a) the image
# ---------------------------------------------------------------------------------------------


def test_one_service_builds_the_image_and_the_others_never_pull_it() -> None:
    """Each service that said ``build:`` built the same tag again: compose runs the builds at
    once (buildx bake), and a first ``up`` failed with 'image "agent-reach:local": already
    exists'. Without ``build:``, a service whose image is missing is pulled from a registry
    unless it says ``pull_policy: never``: there is no agent-reach there."""
    # given the services that run the project image
    services = compose.reach_services()
    assert {"migrate", "api", "worker-echo", "bridge", "fakemodel"} <= set(services)
    # expect one build, by migrate, which every other service waits for or comes after
    assert [name for name, svc in services.items() if "build" in svc] == ["migrate"]
    assert not [
        name for name, svc in compose.services().items() if "build" in svc and name not in services
    ]
    for name, service in services.items():
        if name != "migrate":
            assert service.get("pull_policy") == "never", name


def test_every_build_points_at_a_dockerfile_that_exists() -> None:
    # given the services that build the project image
    built = {n: svc for n, svc in compose.reach_services().items() if "build" in svc}
    assert built, "no service has build:, so nothing builds the project image"
    for name, service in built.items():
        # when the build context and Dockerfile path are resolved against the compose file
        build = service["build"]
        if isinstance(build, str):
            context, dockerfile = build, "Dockerfile"
        else:
            context, dockerfile = build.get("context", "."), build.get("dockerfile", "Dockerfile")
        path = (COMPOSE_FILE.parent / context / dockerfile).resolve()
        # expect the file to exist
        assert path.is_file(), f"{name}: build points at {path}, which does not exist"


def test_dockerfile_copies_only_paths_that_exist() -> None:
    # given the Dockerfile's COPY instructions from the build context (not from another stage)
    copies = [
        args
        for keyword, args in compose.dockerfile_instructions()
        if keyword in {"COPY", "ADD"} and "--from=" not in args
    ]
    assert copies, "the Dockerfile copies nothing into the image"
    for args in copies:
        # when each source is resolved against the build context (the repo root)
        *sources, _dest = [a for a in shlex.split(args) if not a.startswith("--")]
        for source in sources:
            # expect it to exist, or `docker build` fails on the COPY
            assert (ROOT / source).exists(), f"COPY {source}: not in the build context"


def test_the_build_context_keeps_what_the_dockerfile_copies_and_leaves_the_rest_out() -> None:
    # given .dockerignore and the Dockerfile's COPY sources
    patterns = compose.dockerignore()
    sources = [
        source
        for keyword, args in compose.dockerfile_instructions()
        if keyword in {"COPY", "ADD"} and "--from=" not in args
        for source in [a for a in shlex.split(args) if not a.startswith("--")][:-1]
    ]
    # expect every source sent to the build (else the COPY finds nothing), and the local
    # environment, caches and history not (the build context is sent whole, .venv and all)
    assert sources
    for source in sources:
        assert not compose.ignored(source, patterns), f"COPY {source}: left out by .dockerignore"
    for local in (".venv/bin/python", ".git/HEAD", ".reach/logs/api.log", "api/__pycache__/a.pyc"):
        assert compose.ignored(local, patterns), f"{local} goes into the build context"


def test_dockerfile_is_slim_non_root_installs_without_dev_extras_and_exposes_the_api() -> None:
    # given the Dockerfile
    instructions = compose.dockerfile_instructions()
    # when its base images, user, install and exposed ports are read
    bases = [args.split()[0] for keyword, args in instructions if keyword == "FROM"]
    users = [args for keyword, args in instructions if keyword == "USER"]
    runs = " ".join(args for keyword, args in instructions if keyword == "RUN")
    exposed = " ".join(args for keyword, args in instructions if keyword == "EXPOSE").split()
    # expect python:3.11-slim, a final non-root USER, pip install without [dev], port 8000
    assert bases and all(base == "python:3.11-slim" for base in bases), bases
    assert users and users[-1].split(":")[0] not in {"root", "0"}, users
    assert "pip install" in runs
    assert "[dev" not in runs and "[embedded" not in runs, "dev/embedded extras in the image"
    assert "8000" in exposed
    assert compose.dockerfile_cmd()[:2] == ["reach", "api"], "the default CMD should be the API"


# ---------------------------------------------------------------------------------------------
# (b) the shared environment is made of Settings fields
# ---------------------------------------------------------------------------------------------


def _accepted_env_names() -> set[str]:
    prefix = str(Settings.model_config.get("env_prefix", ""))
    names: set[str] = set()
    for field_name, info in Settings.model_fields.items():
        names.add((prefix + field_name).upper())
        alias = info.validation_alias
        if isinstance(alias, str):
            names.add(alias.upper())
        elif alias is not None and hasattr(alias, "choices"):
            names |= {c.upper() for c in alias.choices if isinstance(c, str)}
        if info.alias:
            names.add(info.alias.upper())
    return names


def test_shared_env_names_are_all_settings_fields() -> None:
    # given the shared environment (the x-reach-env anchor)
    env = compose.document().get(SHARED_ENV_KEY)
    assert isinstance(env, dict) and env, f"no {SHARED_ENV_KEY} mapping in docker-compose.yml"
    # when its names are compared with what Settings reads
    unknown = set(env) - _accepted_env_names()
    # expect none that Settings would silently ignore (extra="ignore")
    assert not unknown, f"not Settings fields: {sorted(unknown)}"
    assert {"REACH_DATABASE_URL", "REACH_REDIS_URL", "REACH_AGENTS"} <= set(env)


def test_shared_env_parses_into_settings_that_point_at_the_compose_services(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # given the shared environment, and nothing else REACH_-prefixed
    env = compose.document()[SHARED_ENV_KEY]
    for name in _accepted_env_names():
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    # when Settings is built from it
    settings = Settings()
    # expect the database and redis URLs to name compose services, and the examples to load
    services = set(compose.services())
    db = urlsplit(settings.database_url)
    assert db.scheme == "postgresql+psycopg", "SQLAlchemy URL with the psycopg 3 driver"
    assert db.hostname in services, f"database host {db.hostname!r} is not a service"
    assert urlsplit(settings.redis_url).hostname in services
    assert urlsplit(settings.celery_broker_url).hostname in services
    assert "workers.examples" in settings.agents


def test_every_reach_service_gets_the_shared_env() -> None:
    # given the shared env and the services running the project image
    shared = compose.document()[SHARED_ENV_KEY]
    for name, service in compose.reach_services().items():
        # when the service's environment is read
        env = service.get("environment")
        # expect it to contain the shared env unchanged
        assert isinstance(env, dict), f"{name}: environment is not the shared mapping"
        assert {k: env.get(k) for k in shared} == shared, f"{name}: shared env differs"


# ---------------------------------------------------------------------------------------------
# (c) the commands name things that exist
# ---------------------------------------------------------------------------------------------


def test_reach_is_a_console_script_whose_target_exists() -> None:
    # given the commands that run `reach`
    users = {n: argv for n, argv in compose.all_commands().items() if argv and argv[0] == "reach"}
    assert users, "nothing runs `reach` (migrate should)"
    # when the client distribution's [project.scripts] entry for it is resolved (the image
    # installs ./client, which owns the command)
    client = ROOT / "client"
    scripts = tomllib.loads((client / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    target = scripts.get("scripts", {}).get("reach")
    assert target, "`reach` is not in client/pyproject.toml's [project.scripts]"
    module, _, attr = target.partition(":")
    path = compose.module_file(module, client)
    # expect the module file to exist and to define the function
    assert path is not None, f"reach -> {target}: {module} has no source file"
    assert compose.defines_top_level(path.read_text(encoding="utf-8"), attr), (
        f"{module} lacks {attr}"
    )


def test_the_operator_commands_join_reach_through_their_entry_point() -> None:
    # given the project's entry points in the `reach.commands` group (migrate is one)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    group = project.get("entry-points", {}).get("reach.commands", {})
    assert group, "the project registers no `reach.commands`: `reach migrate` would not exist"
    for target in group.values():
        module, _, attr = target.partition(":")
        path = compose.module_file(module)
        # expect each to name a function that exists
        assert path is not None, f"{target}: {module} has no source file"
        assert compose.defines_top_level(path.read_text(encoding="utf-8"), attr), target


def _api_commands() -> dict[str, list[str]]:
    return {n: argv for n, argv in compose.all_commands().items() if argv[:2] == ["reach", "api"]}


def test_every_api_command_is_reach_api_on_port_8000_as_the_command_parses_it() -> None:
    # given every command that serves the API (the api service and the Dockerfile CMD)
    runs = _api_commands()
    assert "api" in runs and "Dockerfile CMD" in runs, sorted(compose.all_commands())
    for name, argv in runs.items():
        # when the `reach` command's own parser reads it, ${VAR:-default} as its default
        defaults = [compose.interpolation_default(a) for a in argv[1:]]
        args = [a if d is None else d[1] for a, d in zip(argv[1:], defaults, strict=True)]
        parsed = cli_parser().parse_args(args)
        # expect `reach api` on all interfaces, port 8000, run by the operator's handler
        assert (parsed.host, parsed.port) == ("0.0.0.0", 8000), name
        assert callable(parsed.handler), name


def test_reach_api_serves_the_app_factory_with_its_bounded_protocol() -> None:
    # given what `reach api` hands uvicorn
    module, _, factory = reach_cli.API_APP.partition(":")
    protocol_module, _, protocol = reach_cli.API_PROTOCOL.partition(":")
    # expect a factory that exists, and the protocol that bounds each connection's kernel
    # send buffer (no service runs uvicorn around it: any that did would need it too)
    for target, attr in ((module, factory), (protocol_module, protocol)):
        path = compose.module_file(target)
        assert path is not None, f"{target} has no source file"
        assert compose.defines_top_level(path.read_text(encoding="utf-8"), attr), target
    bare = {n: argv for n, argv in compose.all_commands().items() if argv[:1] == ["uvicorn"]}
    for name, argv in bare.items():
        assert compose.option(argv, "--http") == reach_cli.API_PROTOCOL, name
        assert "--factory" in argv and reach_cli.API_APP in argv, name


def test_the_api_runs_a_configurable_number_of_uvicorn_processes() -> None:
    # given the api service's command
    argv = compose.command_argv(compose.services()["api"])
    # when its --workers value is read
    workers = compose.option(argv, "--workers")
    assert workers is not None, f"the api runs one uvicorn process only: {argv}"
    found = compose.interpolation_default(workers)
    # expect it set from the environment (API_WORKERS), more than one process by default:
    # any API process answers any stream or sync wait, the events go through Redis
    assert found is not None, f"--workers {workers} is not ${{API_WORKERS:-N}}"
    variable, default = found
    assert variable == "API_WORKERS", variable
    assert default.isdigit() and int(default) >= 2, default


def test_celery_app_is_the_workers_package() -> None:
    # given every celery command
    runs = {n: argv for n, argv in compose.all_commands().items() if argv and argv[0] == "celery"}
    assert runs, "no celery commands"
    for name, argv in runs.items():
        # when its -A app is resolved
        app = compose.option(argv, "-A", "--app")
        # expect the `workers` package (a directory with __init__.py, where the app lives),
        # or for the bridge its own package inside it
        expected = BRIDGE_APP if name == "bridge" else "workers"
        assert app == expected, f"{name}: -A {app}"
        assert (ROOT / app.replace(".", "/") / "__init__.py").is_file(), f"{app} is no package"


def test_the_bridge_serves_registrations_on_the_threads_pool() -> None:
    # given the bridge service
    argv = compose.celery_services("worker")["bridge"]
    # expect its own app, no queue named (registrations bring theirs), many calls at once
    assert compose.option(argv, "-A", "--app") == BRIDGE_APP
    assert not compose.queues(argv)
    assert compose.option(argv, "-P", "--pool") == "threads"
    assert int(compose.option(argv, "--concurrency", "-c") or 0) >= 100
    assert compose.option(argv, "-n", "--hostname") == "bridge@%h"


# ---------------------------------------------------------------------------------------------
# (d) one worker per example capability
# ---------------------------------------------------------------------------------------------


def _capability_workers() -> dict[str, list[str]]:
    return {
        name: argv
        for name, argv in compose.celery_services("worker").items()
        if not compose.queues(argv) & SYSTEM_QUEUES
        and compose.option(argv, "-A", "--app") != BRIDGE_APP
    }


def test_one_worker_service_per_capability() -> None:
    # given the worker services that are not the system worker
    workers = _capability_workers()
    # when their queues are read
    per_service = {name: compose.queues(argv) for name, argv in workers.items()}
    all_queues = [q for queues in per_service.values() for q in queues]
    # expect one queue each, each capability exactly once, and nothing else
    assert all(len(q) == 1 for q in per_service.values()), per_service
    assert sorted(all_queues) == sorted(CAPABILITIES), per_service
    for name, argv in workers.items():
        (queue,) = compose.queues(argv)
        assert compose.option(argv, "-n", "--hostname") == f"{queue}@%h", name
        if queue in ASYNC_CAPABILITIES:
            assert compose.option(argv, "-P", "--pool") == "threads", name
            assert compose.option(argv, "--concurrency", "-c") == ASYNC_CAPABILITIES[queue], name
        else:
            assert compose.option(argv, "--concurrency", "-c") == "2", name


def test_worker_queues_are_the_capabilities_the_examples_declare() -> None:
    # given the capabilities declared by @<agent>.capability("<name>") in workers/examples/*.py
    declared = compose.example_capabilities()
    # when compared with the queues the capability workers consume
    served = set().union(*(compose.queues(argv) for argv in _capability_workers().values()))
    # expect the same set: no capability without a worker, no worker without a capability
    assert declared == CAPABILITIES, f"workers/examples declares {sorted(declared)}"
    assert served == declared


# ---------------------------------------------------------------------------------------------
# (e) the system worker
# ---------------------------------------------------------------------------------------------


def test_each_internal_queue_has_a_worker_of_its_own() -> None:
    # given the worker services that consume an internal queue
    system = {
        name: argv
        for name, argv in compose.celery_services("worker").items()
        if compose.queues(argv) & SYSTEM_QUEUES
    }
    # when their queues are read
    taken = {name: compose.queues(argv) for name, argv in system.items()}
    # expect one worker per internal queue, taking that queue only: maintenance (reaper,
    # sweepers, janitor) never waits behind webhook deliveries, nor they behind agents
    assert taken == {name: {queue} for name, queue in SYSTEM_WORKERS.items()}, taken
    for name, queue in SYSTEM_WORKERS.items():
        expected = f"{queue.removeprefix('reach.')}@%h"
        assert compose.option(system[name], "-n", "--hostname") == expected


def test_the_webhooks_worker_has_more_slots_than_one_tenant_may_hold() -> None:
    # given the webhooks worker's concurrency and the default per-tenant bound
    argv = compose.celery_services("worker")["worker-webhooks"]
    concurrency = compose.option(argv, "--concurrency", "-c")
    bound = Settings.model_fields["webhook_max_inflight_per_tenant"].default
    # expect room left for other tenants when one holds all it may
    assert concurrency is not None and int(concurrency) > bound, (concurrency, bound)


def test_beat_and_flower_run_once() -> None:
    # given the celery services that are not workers
    beats = compose.celery_services("beat")
    flowers = compose.celery_services("flower")
    # expect a single beat (two would schedule every task twice) with a writable schedule file
    assert list(beats) == ["beat"], sorted(beats)
    assert compose.option(beats["beat"], "--schedule", "-s") == "/tmp/celerybeat-schedule"
    assert list(flowers) == ["flower"], sorted(flowers)
    assert compose.option(flowers["flower"], "--port") == "5555"


# ---------------------------------------------------------------------------------------------
# (f) start-up order, health checks, shutdown, redis policy
# ---------------------------------------------------------------------------------------------


def test_depends_on_only_names_defined_services() -> None:
    services = compose.services()
    for name, service in services.items():
        missing = set(compose.depends_on(service)) - set(services)
        assert not missing, f"{name} depends on undefined {sorted(missing)}"


def test_migrate_is_a_one_shot_after_postgres_is_healthy() -> None:
    # given the migrate service
    migrate = compose.services().get("migrate")
    assert migrate is not None, "no migrate service"
    # expect `reach migrate`, after a healthy postgres, never restarted once it exits 0
    assert compose.command_argv(migrate) == ["reach", "migrate"]
    assert compose.depends_on(migrate).get("postgres") == "service_healthy"
    assert str(migrate.get("restart", "no")) in {"no", "on-failure"}


def test_api_and_celery_processes_start_after_migrate_and_healthy_redis() -> None:
    # given the api and every celery process
    dependants = ["api", *sorted(compose.celery_services())]
    services = compose.services()
    # api, one worker per capability, the maintenance and webhooks workers, the bridge, beat,
    # flower
    assert len(dependants) == 1 + len(CAPABILITIES) + 2 + 1 + 2
    for name in dependants:
        # when its depends_on is read
        deps = compose.depends_on(services[name])
        # expect migrate to have completed successfully and redis to be healthy
        assert deps.get("migrate") == "service_completed_successfully", f"{name}: {deps}"
        assert deps.get("redis") == "service_healthy", f"{name}: {deps}"


def test_postgres_and_redis_have_healthchecks() -> None:
    services = compose.services()
    # given the two backing services
    postgres, redis = services["postgres"], services["redis"]
    # expect pg_isready and redis-cli ping health checks, on the images the contract names
    assert postgres.get("image") == "postgres:16"
    assert "pg_isready" in compose.healthcheck_text(postgres)
    # over TCP: on a fresh volume the image's first server listens on its socket alone, and
    # a socket check found it ready before migrate could connect
    check = postgres["healthcheck"]["test"]
    assert compose.option([str(part) for part in check], "-h", "--host") == "127.0.0.1", check
    assert redis.get("image") == "redis:7"
    assert re.search(r"redis-cli\s+ping", compose.healthcheck_text(redis))


def test_postgres_data_lives_in_a_named_volume() -> None:
    # given postgres's volumes and the top-level named volumes
    postgres = compose.services()["postgres"]
    named = set(compose.document().get("volumes") or {})
    mounts = [str(v) for v in postgres.get("volumes") or []]
    # expect the data directory mounted from a declared named volume
    sources = {m.split(":", 1)[0] for m in mounts if m.endswith(":/var/lib/postgresql/data")}
    assert sources and sources <= named, f"postgres data not on a named volume: {mounts}"


def test_redis_never_evicts_and_persists() -> None:
    # given redis's command line
    argv = compose.command_argv(compose.services()["redis"])
    # expect redis-server with noeviction (a Celery broker must never drop messages) and AOF
    assert argv[:1] == ["redis-server"]
    assert compose.option(argv, "--maxmemory-policy") == "noeviction", argv
    assert compose.option(argv, "--appendonly") == "yes", argv


def test_api_healthcheck_probes_healthz_without_curl() -> None:
    # given the api health check
    text = compose.healthcheck_text(compose.services()["api"])
    # expect python's urllib against /healthz on port 8000 (slim images have no curl)
    assert "python" in text and "urllib" in text, text
    assert "8000/healthz" in text
    assert "curl" not in text


def test_workers_shut_down_warm() -> None:
    # given every celery worker service: those the deployment relies on among them (none
    # found would check nothing)
    services = compose.services()
    workers = compose.celery_services("worker")
    assert {"worker-echo", "worker-maintenance", "worker-webhooks", "bridge"} <= set(workers), (
        sorted(workers)
    )
    for name in workers:
        service = services[name]
        # expect SIGTERM (Celery's warm shutdown) and at least 60s before the SIGKILL
        assert service.get("stop_signal") == "SIGTERM", name
        grace = service.get("stop_grace_period")
        assert grace is not None and compose.duration_s(grace) >= 60, f"{name}: {grace}"


def test_a_capabilitys_worker_waits_for_its_longest_task_before_the_sigkill() -> None:
    """A task still running at the SIGKILL is delivered again, or ends ``worker_lost`` when
    its agent is not idempotent: llm.complete (120 s) was given 60."""
    timeouts = compose.example_timeouts()
    services = compose.services()
    assert set(timeouts) == CAPABILITIES, timeouts  # every example names its time limit
    for name, argv in _capability_workers().items():
        (queue,) = compose.queues(argv)
        grace = compose.duration_s(services[name]["stop_grace_period"])
        assert grace > timeouts[queue], f"{name}: {grace} s for tasks of up to {timeouts[queue]}"


def test_every_process_stops_on_its_stop_signal() -> None:
    """The stand-in model is PID 1 of its container and handles no SIGTERM (the kernel drops
    it there): ``docker compose down`` waited 10 s and killed it."""
    fakemodel = compose.services()["fakemodel"]
    assert compose.command_argv(fakemodel)[:3] == ["python", "-m", "reach.fakemodel"]
    source = (ROOT / "reach" / "fakemodel.py").read_text(encoding="utf-8")
    assert "KeyboardInterrupt" in source and "SIGTERM" not in source
    assert fakemodel.get("stop_signal") == "SIGINT"


def test_postgres_admits_every_connection_the_services_may_open_at_once() -> None:
    """Each process's most, from the code: an API process's engine (pool and overflow) and
    two connections of its own (submissions, usage); a prefork worker process's engine and
    two of its own (claims, finishes); a threads worker process's pool, two of its own and
    two of its event loop's; each worker node's lease keeper, an engine of its own."""
    assert inspect.signature(async_engine).parameters["pool_size"].default == 20
    sync = inspect.signature(sync_engine).parameters
    per_api = 20 + 10 + 2
    per_prefork = sync["pool_size"].default + sync["max_overflow"].default + 2
    per_threads = THREADED_DB_POOL + 2 + 2
    per_node = sync["pool_size"].default + sync["max_overflow"].default
    services = compose.services()
    api_argv = compose.command_argv(services["api"])
    variable, default = compose.interpolation_default(
        compose.option(api_argv, "--workers") or ""
    ) or ("", "1")
    assert variable == "API_WORKERS"
    most = 0
    for api_workers in (int(default), 4):  # the default, and what the file's head suggests
        total = per_api * api_workers
        for argv in compose.celery_services("worker").values():
            threads = compose.option(argv, "-P", "--pool") == "threads"
            processes = int(compose.option(argv, "--concurrency", "-c") or 2)
            total += per_node + (per_threads if threads else per_prefork * processes)
        most = max(most, total)
    argv = compose.command_argv(services["postgres"])
    settings = dict(arg.split("=", 1) for arg in argv[1:] if "=" in arg)
    reserved = 3  # superuser_reserved_connections
    assert most + reserved <= int(settings["max_connections"]), most


def test_the_api_has_time_to_close_its_connections_before_the_sigkill() -> None:
    # given the api service, run by `reach api`, which closes what is left after its timeout
    api = compose.services()["api"]
    assert api["command"][:2] == ["reach", "api"]
    # expect a grace period past that timeout (Docker's default, 10 s, is not)
    grace = api.get("stop_grace_period")
    assert grace is not None and compose.duration_s(grace) > reach_cli.API_STOP_TIMEOUT_S, grace


# ---------------------------------------------------------------------------------------------
# (g) published ports
# ---------------------------------------------------------------------------------------------


def test_the_api_is_published_on_port_8000() -> None:
    # given the api's ports, expect the container port published on the same host port
    published = compose.published_container_ports(compose.services()["api"])
    assert (8000, 8000) in published, published


def test_flower_is_published_on_loopback_only_and_behind_basic_auth() -> None:
    # given Flower, which can revoke and terminate tasks
    flower = compose.services()["flower"]
    # when its ports and its environment are read
    published = compose.published(flower)
    auth = str((flower.get("environment") or {}).get("FLOWER_BASIC_AUTH", ""))
    argv = compose.command_argv(flower)
    # expect port 5555 on this machine's loopback only, and a password compose insists on
    # (${VAR:?...} stops `docker compose up` when it is unset), read from the environment
    assert published == {("127.0.0.1", 5555, 5555)}, published
    assert re.fullmatch(r"\$\{FLOWER_BASIC_AUTH:\?[^}]+\}", auth), auth
    assert not [a for a in argv if a.startswith("--basic-auth") or a.startswith("--auth")]


def test_no_worker_publishes_or_exposes_a_port_and_metrics_listen_on_loopback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # given every celery worker and beat service (some of each: none would check nothing)
    services = compose.services()
    workers, beats = compose.celery_services("worker"), compose.celery_services("beat")
    assert workers and beats, (sorted(workers), sorted(beats))
    for name in [*workers, *beats]:
        service = services[name]
        # expect no published or exposed port, and not the host's network
        assert not service.get("ports") and not service.get("expose"), name
        assert service.get("network_mode") != "host", name
        # and its metrics (Settings from its environment) on the container's loopback
        for variable in _accepted_env_names():
            monkeypatch.delenv(variable, raising=False)
        for variable, value in (service.get("environment") or {}).items():
            monkeypatch.setenv(variable, str(value))
        assert Settings().worker_metrics_host in ("127.0.0.1", "::1"), name


def test_only_api_and_flower_publish_ports() -> None:
    # given every service, expect postgres, redis and the workers not to be reachable from outside
    publishing = {name for name, svc in compose.services().items() if svc.get("ports")}
    assert publishing == {"api", "flower"}
