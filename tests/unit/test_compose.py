"""docker-compose.yml and the Dockerfile, checked without a Docker engine.

There is no Docker engine where these tests run, so the compose file has to be right by
construction. These tests read it (and the Dockerfile) as data and check it against the project:
the Dockerfile exists and copies files that exist, the shared environment is made of
``broker.settings.Settings`` fields, every command names a console script / module / attribute /
package that exists, there is one worker per declared example capability, the system worker
takes only the internal queues, and the start-up order and health checks are what the contract
says.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from broker.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"

# The example capabilities, one worker service each (the contract).
CAPABILITIES = {"echo", "invoice.extract", "text.summarize"}
# The internal queues the system worker consumes.
SYSTEM_QUEUES = {"reach.maintenance", "reach.webhooks"}
SHARED_ENV_KEY = "x-reach-env"


# ---------------------------------------------------------------------------------------------
# Helpers: reading the files
# ---------------------------------------------------------------------------------------------


def _compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
    assert isinstance(data, dict), "docker-compose.yml is not a mapping"
    return data


def _services() -> dict[str, dict[str, Any]]:
    services = _compose().get("services")
    assert isinstance(services, dict) and services, "docker-compose.yml has no services"
    return services


def _argv(service: dict[str, Any]) -> list[str]:
    """The service's command as an argv list (compose accepts a string or a list)."""
    command = service.get("command")
    if command is None:
        return []
    if isinstance(command, str):
        return shlex.split(command)
    return [str(part) for part in command]


def _option(argv: list[str], *names: str) -> str | None:
    """The value of ``-X value`` / ``--long value`` / ``--long=value`` in argv, or None."""
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if name.startswith("--") and arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def _celery_services(subcommand: str | None = None) -> dict[str, list[str]]:
    """Services running `celery ... <subcommand>` (any celery command when subcommand is None)."""
    out = {}
    for name, service in _services().items():
        argv = _argv(service)
        if argv[:1] == ["celery"] and (subcommand is None or subcommand in argv[1:]):
            out[name] = argv
    return out


def _queues(argv: list[str]) -> set[str]:
    value = _option(argv, "-Q", "--queues")
    return {q.strip() for q in value.split(",") if q.strip()} if value else set()


def _depends_on(service: dict[str, Any]) -> dict[str, str]:
    """depends_on as {service: condition}; the short (list) form means service_started."""
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {name: (spec or {}).get("condition", "service_started") for name, spec in deps.items()}


def _healthcheck_text(service: dict[str, Any]) -> str:
    test = (service.get("healthcheck") or {}).get("test")
    if isinstance(test, list):
        return " ".join(str(part) for part in test)
    return str(test or "")


def _published_container_ports(service: dict[str, Any]) -> set[tuple[int, int]]:
    """{(host_port, container_port)} for the short ("8000:8000") and long port syntaxes."""
    ports: set[tuple[int, int]] = set()
    for entry in service.get("ports") or []:
        if isinstance(entry, dict):
            ports.add((int(entry["published"]), int(entry["target"])))
            continue
        text = str(entry).split("/", 1)[0]  # drop "/tcp"
        parts = text.split(":")
        if len(parts) == 1:  # container port only: published on a random host port
            continue
        ports.add((int(parts[-2]), int(parts[-1])))
    return ports


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)")
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 0.000001}


def _duration_s(value: str | int) -> float:
    """A compose duration ("60s", "1m30s") in seconds."""
    if isinstance(value, int):
        return float(value)
    text = value.strip()
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a compose duration: {value!r}")
    return sum(float(n) * _UNIT_S[u] for n, u in parts)


def _module_file(dotted: str) -> Path | None:
    """The source file of a project module (``a.b`` -> a/b.py or a/b/__init__.py), or None."""
    base = ROOT.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _defines_top_level(source: str, name: str) -> bool:
    """Whether a module's source defines ``name`` at top level (def, class, assignment, import)."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if node.name == name:
                return True
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(target)):
                    return True
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            if isinstance(node.target, ast.Name) and node.target.id == name:
                return True
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                bound = alias.asname or alias.name.split(".")[0]
                if bound == name:
                    return True
    return False


def _declared_capabilities(source: str) -> set[str]:
    """Names given to ``<anything>.capability("<name>", ...)`` calls (the decorators)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if not (isinstance(func, ast.Attribute) and func.attr == "capability"):
            continue
        arg: ast.expr | None = node.args[0] if node.args else None
        if arg is None:
            arg = next((kw.value for kw in node.keywords if kw.arg == "name"), None)
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            names.add(arg.value)
    return names


def _example_capabilities() -> set[str]:
    names: set[str] = set()
    for path in sorted((ROOT / "workers" / "examples").glob("*.py")):
        names |= _declared_capabilities(path.read_text(encoding="utf-8"))
    return names


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, comments dropped and continuation lines joined."""
    logical: list[str] = []
    pending = ""
    for raw in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    if pending:
        logical.append(pending)
    out = []
    for line in logical:
        keyword, _, rest = line.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


def _dockerfile_cmd() -> list[str]:
    cmds = [args for keyword, args in _dockerfile_instructions() if keyword == "CMD"]
    assert cmds, "the Dockerfile has no CMD"
    value = json.loads(cmds[-1])  # exec form, so signals reach the process
    assert isinstance(value, list)
    return [str(part) for part in value]


def _all_commands() -> dict[str, list[str]]:
    """Every command that will run: each service's, plus the Dockerfile's default CMD."""
    commands = {name: _argv(svc) for name, svc in _services().items() if svc.get("command")}
    commands["Dockerfile CMD"] = _dockerfile_cmd()
    return commands


def _reach_services() -> dict[str, dict[str, Any]]:
    """The services that run the project's image (everything but postgres and redis)."""
    return {name: svc for name, svc in _services().items() if "build" in svc}


# ---------------------------------------------------------------------------------------------
# The helpers can fail: they are what the checks below stand on
# ---------------------------------------------------------------------------------------------


def test_top_level_definition_finder_tells_defined_from_undefined() -> None:
    # given a module with a function, an assignment and an import
    source = "import os\nfrom x import y as z\ndef f(): pass\napp = 1\nif True:\n    hidden = 2\n"
    # when / expect each top-level name is found, and nothing else
    for name in ("os", "z", "f", "app"):
        assert _defines_top_level(source, name), name
    for name in ("y", "hidden", "g"):
        assert not _defines_top_level(source, name), name


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
    found = _declared_capabilities(source)
    # expect exactly the decorated names
    assert found == {"echo", "text.summarize"}


def test_port_and_duration_parsers_read_compose_syntax() -> None:
    # given the port and duration spellings compose accepts
    service = {"ports": ["8000:8000", "127.0.0.1:5555:5555/tcp", {"target": 1, "published": 2}]}
    # when / expect they parse to (host, container) pairs and seconds
    assert _published_container_ports(service) == {(8000, 8000), (5555, 5555), (2, 1)}
    assert _duration_s("60s") == 60
    assert _duration_s("1m30s") == 90
    with pytest.raises(ValueError):
        _duration_s("sixty")


# ---------------------------------------------------------------------------------------------
# (a) the image
# ---------------------------------------------------------------------------------------------


def test_every_build_points_at_a_dockerfile_that_exists() -> None:
    # given the services that build the project image
    built = _reach_services()
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
        for keyword, args in _dockerfile_instructions()
        if keyword in {"COPY", "ADD"} and "--from=" not in args
    ]
    assert copies, "the Dockerfile copies nothing into the image"
    for args in copies:
        # when each source is resolved against the build context (the repo root)
        *sources, _dest = [a for a in shlex.split(args) if not a.startswith("--")]
        for source in sources:
            # expect it to exist, or `docker build` fails on the COPY
            assert (ROOT / source).exists(), f"COPY {source}: not in the build context"


def test_dockerfile_is_slim_non_root_installs_without_dev_extras_and_exposes_the_api() -> None:
    # given the Dockerfile
    instructions = _dockerfile_instructions()
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
    assert _dockerfile_cmd()[0] == "uvicorn", "the default CMD should be the API"


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
    env = _compose().get(SHARED_ENV_KEY)
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
    env = _compose()[SHARED_ENV_KEY]
    for name in _accepted_env_names():
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    # when Settings is built from it
    settings = Settings()
    # expect the database and redis URLs to name compose services, and the examples to load
    services = set(_services())
    db = urlsplit(settings.database_url)
    assert db.scheme == "postgresql+psycopg", "SQLAlchemy URL with the psycopg 3 driver"
    assert db.hostname in services, f"database host {db.hostname!r} is not a service"
    assert urlsplit(settings.redis_url).hostname in services
    assert urlsplit(settings.celery_broker_url).hostname in services
    assert "workers.examples" in settings.agents


def test_every_reach_service_gets_the_shared_env() -> None:
    # given the shared env and the services running the project image
    shared = _compose()[SHARED_ENV_KEY]
    for name, service in _reach_services().items():
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
    users = {n: argv for n, argv in _all_commands().items() if argv and argv[0] == "reach"}
    assert users, "nothing runs `reach` (migrate should)"
    # when pyproject's [project.scripts] entry for it is resolved
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    target = scripts.get("scripts", {}).get("reach")
    assert target, "`reach` is not in [project.scripts]"
    module, _, attr = target.partition(":")
    path = _module_file(module)
    # expect the module file to exist and to define the function
    assert path is not None, f"reach -> {target}: {module} has no source file"
    assert _defines_top_level(path.read_text(encoding="utf-8"), attr), f"{module} lacks {attr}"


def test_uvicorn_target_module_and_factory_exist() -> None:
    # given every command that runs uvicorn (the api service and the Dockerfile CMD)
    runs = {n: argv for n, argv in _all_commands().items() if argv and argv[0] == "uvicorn"}
    assert "api" in runs and "Dockerfile CMD" in runs, sorted(runs)
    for name, argv in runs.items():
        # when its "module:attribute" is resolved
        spec = next(a for a in argv[1:] if not a.startswith("-"))
        module, _, attr = spec.partition(":")
        path = _module_file(module)
        # expect the module file to define the attribute, called as a factory on port 8000
        assert path is not None, f"{name}: {module} has no source file"
        assert _defines_top_level(path.read_text(encoding="utf-8"), attr), f"{module}.{attr}"
        assert "--factory" in argv, f"{name}: {attr} is a factory; uvicorn needs --factory"
        assert _option(argv, "--host") == "0.0.0.0" and _option(argv, "--port") == "8000"


def test_celery_app_is_the_workers_package() -> None:
    # given every celery command
    runs = {n: argv for n, argv in _all_commands().items() if argv and argv[0] == "celery"}
    assert runs, "no celery commands"
    for name, argv in runs.items():
        # when its -A app is resolved
        app = _option(argv, "-A", "--app")
        # expect the `workers` package (a directory with __init__.py, where the app lives)
        assert app == "workers", f"{name}: -A {app}"
        assert (ROOT / "workers" / "__init__.py").is_file(), "workers/ is not a package yet"


# ---------------------------------------------------------------------------------------------
# (d) one worker per example capability
# ---------------------------------------------------------------------------------------------


def _capability_workers() -> dict[str, list[str]]:
    return {
        name: argv
        for name, argv in _celery_services("worker").items()
        if not _queues(argv) & SYSTEM_QUEUES
    }


def test_one_worker_service_per_capability() -> None:
    # given the worker services that are not the system worker
    workers = _capability_workers()
    # when their queues are read
    per_service = {name: _queues(argv) for name, argv in workers.items()}
    all_queues = [q for queues in per_service.values() for q in queues]
    # expect one queue each, each capability exactly once, and nothing else
    assert all(len(q) == 1 for q in per_service.values()), per_service
    assert sorted(all_queues) == sorted(CAPABILITIES), per_service
    for name, argv in workers.items():
        (queue,) = _queues(argv)
        assert _option(argv, "-n", "--hostname") == f"{queue}@%h", name
        assert _option(argv, "--concurrency", "-c") == "2", name


def test_worker_queues_are_the_capabilities_the_examples_declare() -> None:
    # given the capabilities declared by @<agent>.capability("<name>") in workers/examples/*.py
    declared = _example_capabilities()
    # when compared with the queues the capability workers consume
    served = set().union(*(_queues(argv) for argv in _capability_workers().values()))
    # expect the same set: no capability without a worker, no worker without a capability
    assert declared == CAPABILITIES, f"workers/examples declares {sorted(declared)}"
    assert served == declared


# ---------------------------------------------------------------------------------------------
# (e) the system worker
# ---------------------------------------------------------------------------------------------


def test_system_worker_takes_the_internal_queues_only() -> None:
    # given the worker services that consume an internal queue
    system = {
        name: argv
        for name, argv in _celery_services("worker").items()
        if _queues(argv) & SYSTEM_QUEUES
    }
    # when there is exactly one and its queues are read
    assert list(system) == ["worker-system"], sorted(system)
    queues = _queues(system["worker-system"])
    # expect both internal queues and no capability queue
    assert queues == SYSTEM_QUEUES
    assert not queues & CAPABILITIES
    assert _option(system["worker-system"], "-n", "--hostname") == "system@%h"


def test_beat_and_flower_run_once() -> None:
    # given the celery services that are not workers
    beats = _celery_services("beat")
    flowers = _celery_services("flower")
    # expect a single beat (two would schedule every task twice) with a writable schedule file
    assert list(beats) == ["beat"], sorted(beats)
    assert _option(beats["beat"], "--schedule", "-s") == "/tmp/celerybeat-schedule"
    assert list(flowers) == ["flower"], sorted(flowers)
    assert _option(flowers["flower"], "--port") == "5555"


# ---------------------------------------------------------------------------------------------
# (f) start-up order, health checks, shutdown, redis policy
# ---------------------------------------------------------------------------------------------


def test_depends_on_only_names_defined_services() -> None:
    services = _services()
    for name, service in services.items():
        missing = set(_depends_on(service)) - set(services)
        assert not missing, f"{name} depends on undefined {sorted(missing)}"


def test_migrate_is_a_one_shot_after_postgres_is_healthy() -> None:
    # given the migrate service
    migrate = _services().get("migrate")
    assert migrate is not None, "no migrate service"
    # expect `reach migrate`, after a healthy postgres, never restarted once it exits 0
    assert _argv(migrate) == ["reach", "migrate"]
    assert _depends_on(migrate).get("postgres") == "service_healthy"
    assert str(migrate.get("restart", "no")) in {"no", "on-failure"}


def test_api_and_celery_processes_start_after_migrate_and_healthy_redis() -> None:
    # given the api and every celery process
    dependants = ["api", *sorted(_celery_services())]
    services = _services()
    assert len(dependants) == 1 + len(CAPABILITIES) + 1 + 2  # api, workers, system, beat, flower
    for name in dependants:
        # when its depends_on is read
        deps = _depends_on(services[name])
        # expect migrate to have completed successfully and redis to be healthy
        assert deps.get("migrate") == "service_completed_successfully", f"{name}: {deps}"
        assert deps.get("redis") == "service_healthy", f"{name}: {deps}"


def test_postgres_and_redis_have_healthchecks() -> None:
    services = _services()
    # given the two backing services
    postgres, redis = services["postgres"], services["redis"]
    # expect pg_isready and redis-cli ping health checks, on the images the contract names
    assert postgres.get("image") == "postgres:16"
    assert "pg_isready" in _healthcheck_text(postgres)
    assert redis.get("image") == "redis:7"
    assert re.search(r"redis-cli\s+ping", _healthcheck_text(redis))


def test_postgres_data_lives_in_a_named_volume() -> None:
    # given postgres's volumes and the top-level named volumes
    postgres = _services()["postgres"]
    named = set(_compose().get("volumes") or {})
    mounts = [str(v) for v in postgres.get("volumes") or []]
    # expect the data directory mounted from a declared named volume
    sources = {m.split(":", 1)[0] for m in mounts if m.endswith(":/var/lib/postgresql/data")}
    assert sources and sources <= named, f"postgres data not on a named volume: {mounts}"


def test_redis_never_evicts_and_persists() -> None:
    # given redis's command line
    argv = _argv(_services()["redis"])
    # expect redis-server with noeviction (a Celery broker must never drop messages) and AOF
    assert argv[:1] == ["redis-server"]
    assert _option(argv, "--maxmemory-policy") == "noeviction", argv
    assert _option(argv, "--appendonly") == "yes", argv


def test_api_healthcheck_probes_healthz_without_curl() -> None:
    # given the api health check
    text = _healthcheck_text(_services()["api"])
    # expect python's urllib against /healthz on port 8000 (slim images have no curl)
    assert "python" in text and "urllib" in text, text
    assert "8000/healthz" in text
    assert "curl" not in text


def test_workers_shut_down_warm() -> None:
    # given every celery worker service
    services = _services()
    for name in _celery_services("worker"):
        service = services[name]
        # expect SIGTERM (Celery's warm shutdown) and at least 60s before the SIGKILL
        assert service.get("stop_signal") == "SIGTERM", name
        grace = service.get("stop_grace_period")
        assert grace is not None and _duration_s(grace) >= 60, f"{name}: {grace}"


# ---------------------------------------------------------------------------------------------
# (g) published ports
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("service", "port"), [("api", 8000), ("flower", 5555)])
def test_published_ports(service: str, port: int) -> None:
    # given the service's ports
    published = _published_container_ports(_services()[service])
    # expect the container port published on the same host port
    assert (port, port) in published, f"{service}: {published}"


def test_only_api_and_flower_publish_ports() -> None:
    # given every service, expect postgres, redis and the workers not to be reachable from outside
    publishing = {name for name, svc in _services().items() if svc.get("ports")}
    assert publishing == {"api", "flower"}
