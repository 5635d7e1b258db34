"""``pip install ./client`` in a fresh venv, as a caller would: the client and the ``reach``
command arrive, and nothing of the server (Celery, SQLAlchemy, FastAPI, Redis, Postgres)."""

from __future__ import annotations

import json
import subprocess
import venv
from pathlib import Path

CLIENT = Path(__file__).resolve().parents[2] / "client"
SERVER_PACKAGES = {"celery", "kombu", "sqlalchemy", "fastapi", "starlette", "redis", "psycopg"}


def test_the_client_installs_alone_without_the_server(tmp_path: Path) -> None:
    # given a fresh venv that does not see this one's packages
    venv.create(tmp_path / "venv", with_pip=True, system_site_packages=False)
    python = tmp_path / "venv" / "bin" / "python"
    # when the client is installed from its folder, with its dependencies
    install = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    done = subprocess.run(
        [*install, str(CLIENT)], capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # expect httpx, standardwebhooks and rich, and none of the server's packages
    listed = subprocess.run(
        [str(python), "-m", "pip", "list", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    names = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert {"agent-reach-client", "httpx", "standardwebhooks", "rich"} <= names
    assert not names & SERVER_PACKAGES, names & SERVER_PACKAGES
    assert not {n for n in names if n.startswith(("psycopg", "sqlalchemy", "agent-reach"))} - {
        "agent-reach-client"
    }
    # and the package imports and the command runs
    imported = subprocess.run(
        [str(python), "-c", "import reach_client, sys; print(reach_client.Reach.__name__)"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    assert imported.stdout.strip() == "Reach", imported.stderr
    helped = subprocess.run(
        [str(tmp_path / "venv" / "bin" / "reach"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert helped.returncode == 0 and "submit" in helped.stdout
    assert "migrate" not in helped.stdout, "the operator commands came without the server"
