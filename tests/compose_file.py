"""docker-compose.yml and the Dockerfile read as data, for tests/unit/test_compose.py: there is
no Docker engine where the tests run, so the files are checked by reading them."""

from __future__ import annotations

import ast
import json
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"


def document() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
    assert isinstance(data, dict), "docker-compose.yml is not a mapping"
    return data


def services() -> dict[str, dict[str, Any]]:
    services = document().get("services")
    assert isinstance(services, dict) and services, "docker-compose.yml has no services"
    return services


def command_argv(service: dict[str, Any]) -> list[str]:
    """The service's command as an argv list (compose accepts a string or a list)."""
    command = service.get("command")
    if command is None:
        return []
    if isinstance(command, str):
        return shlex.split(command)
    return [str(part) for part in command]


def option(argv: list[str], *names: str) -> str | None:
    """The value of ``-X value`` / ``--long value`` / ``--long=value`` in argv, or None."""
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if name.startswith("--") and arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def celery_services(subcommand: str | None = None) -> dict[str, list[str]]:
    """Services running `celery ... <subcommand>` (any celery command when subcommand is None)."""
    out = {}
    for name, service in services().items():
        argv = command_argv(service)
        if argv[:1] == ["celery"] and (subcommand is None or subcommand in argv[1:]):
            out[name] = argv
    return out


def queues(argv: list[str]) -> set[str]:
    value = option(argv, "-Q", "--queues")
    return {q.strip() for q in value.split(",") if q.strip()} if value else set()


def depends_on(service: dict[str, Any]) -> dict[str, str]:
    """depends_on as {service: condition}; the short (list) form means service_started."""
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {name: (spec or {}).get("condition", "service_started") for name, spec in deps.items()}


def healthcheck_text(service: dict[str, Any]) -> str:
    test = (service.get("healthcheck") or {}).get("test")
    if isinstance(test, list):
        return " ".join(str(part) for part in test)
    return str(test or "")


def published(service: dict[str, Any]) -> set[tuple[str, int, int]]:
    """{(host address, host port, container port)} for the short ("8000:8000",
    "127.0.0.1:5555:5555/tcp") and long port syntaxes; no address means every interface."""
    ports: set[tuple[str, int, int]] = set()
    for entry in service.get("ports") or []:
        if isinstance(entry, dict):
            address = str(entry.get("host_ip") or "0.0.0.0")
            ports.add((address, int(entry["published"]), int(entry["target"])))
            continue
        text = str(entry).split("/", 1)[0]  # drop "/tcp"
        address, _, pair = text.rpartition(":")
        if not address:  # container port only: published on a random host port
            ports.add(("0.0.0.0", 0, int(pair)))
            continue
        address, _, host_port = address.rpartition(":")
        ports.add((address.strip("[]") or "0.0.0.0", int(host_port), int(pair)))
    return ports


def published_container_ports(service: dict[str, Any]) -> set[tuple[int, int]]:
    """{(host_port, container_port)}: ``published`` without the addresses."""
    return {(host, container) for _, host, container in published(service) if host}


DURATION = re.compile(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)")
UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 0.000001}


def duration_s(value: str | int) -> float:
    """A compose duration ("60s", "1m30s") in seconds."""
    if isinstance(value, int):
        return float(value)
    text = value.strip()
    parts = DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a compose duration: {value!r}")
    return sum(float(n) * UNIT_S[u] for n, u in parts)


INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*):?-([^}]*)\}")


def interpolation_default(value: str) -> tuple[str, str] | None:
    """(variable, default) of a value that is exactly ``${VAR:-default}`` or ``${VAR-default}``
    (what compose substitutes when VAR is unset), or None for anything else."""
    found = INTERPOLATION.fullmatch(value.strip())
    return (found.group(1), found.group(2)) if found else None


def module_file(dotted: str, root: Path = ROOT) -> Path | None:
    """The source file of a module under ``root`` (``a.b`` -> a/b.py or a/b/__init__.py), or
    None."""
    base = root.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def defines_top_level(source: str, name: str) -> bool:
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


def declared_capabilities(source: str) -> set[str]:
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


def declared_timeouts(source: str) -> dict[str, float]:
    """``timeout_s`` of each ``<anything>.capability("<name>", ..., timeout_s=N)`` call that
    gives one as a number."""
    found: dict[str, float] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and declared_capabilities(ast.unparse(node)):
            (name,) = declared_capabilities(ast.unparse(node))
            for keyword in node.keywords:
                value = keyword.value
                if keyword.arg == "timeout_s" and isinstance(value, ast.Constant):
                    found[name] = float(value.value)
    return found


def example_timeouts() -> dict[str, float]:
    found: dict[str, float] = {}
    for path in sorted((ROOT / "workers" / "examples").glob("*.py")):
        found |= declared_timeouts(path.read_text(encoding="utf-8"))
    return found


def example_capabilities() -> set[str]:
    names: set[str] = set()
    for path in sorted((ROOT / "workers" / "examples").glob("*.py")):
        names |= declared_capabilities(path.read_text(encoding="utf-8"))
    return names


def dockerfile_instructions() -> list[tuple[str, str]]:
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


def dockerfile_cmd() -> list[str]:
    cmds = [args for keyword, args in dockerfile_instructions() if keyword == "CMD"]
    assert cmds, "the Dockerfile has no CMD"
    value = json.loads(cmds[-1])  # exec form, so signals reach the process
    assert isinstance(value, list)
    return [str(part) for part in value]


def all_commands() -> dict[str, list[str]]:
    """Every command that will run: each service's, plus the Dockerfile's default CMD."""
    commands = {name: command_argv(svc) for name, svc in services().items() if svc.get("command")}
    commands["Dockerfile CMD"] = dockerfile_cmd()
    return commands


IMAGE = "agent-reach:local"  # the project's image, as its one build tags it


def reach_services() -> dict[str, dict[str, Any]]:
    """The services that run the project's image (everything but postgres and redis)."""
    return {name: svc for name, svc in services().items() if svc.get("image") == IMAGE}


def dockerignore() -> list[str]:
    """The patterns of ``.dockerignore`` (none when there is none), comments dropped."""
    path = ROOT / ".dockerignore"
    if not path.is_file():
        return []
    lines = (line.strip() for line in path.read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether docker leaves ``path`` (relative to the build context) out of it: the last
    pattern that matches it or one of its parent folders decides (``!`` keeps)."""
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    decided = False
    for pattern in patterns:
        keep = pattern.startswith("!")
        text = pattern.lstrip("!").strip("/")
        regex = re.escape(text).replace(r"\*\*/", "(?:.*/)?").replace(r"\*", "[^/]*")
        if any(re.fullmatch(regex.replace(r"\?", "[^/]"), p) for p in prefixes):
            decided = not keep
    return decided
