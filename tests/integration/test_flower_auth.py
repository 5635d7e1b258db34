"""Flower as docker-compose runs it asks for the password it is given in FLOWER_BASIC_AUTH
(compose's Flower has no flag for it: this proves Flower reads the variable)."""

from __future__ import annotations

import re
import secrets
import subprocess
from pathlib import Path

import httpx

from broker.settings import Settings
from tests import compose_file as compose
from tests.eventually import eventually
from tests.integration.stack import BIN, ROOT, environment, free_port


def test_flower_with_the_compose_command_and_environment_refuses_without_the_password(
    settings: Settings, tmp_path: Path
) -> None:
    # Given Flower started with compose's command (on loopback here) and its auth variable
    flower = compose.services()["flower"]
    [variable] = [
        name for name, value in flower["environment"].items() if re.match(r"\$\{", str(value))
    ]
    password = secrets.token_hex(8)
    port = free_port()
    kept = [a for a in compose.command_argv(flower)[1:] if not a.startswith("--port")]
    argv = [str(BIN / "celery"), *kept, f"--port={port}", "--address=127.0.0.1"]
    env = {**environment(settings), variable: f"ops:{password}"}
    with (tmp_path / "flower.log").open("wb") as log:
        process = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=log, stderr=log)
    try:
        url = f"http://127.0.0.1:{port}/"

        def answer() -> httpx.Response | None:
            assert process.poll() is None, "flower exited"
            try:
                return httpx.get(url, timeout=2)
            except httpx.TransportError:
                return None

        anonymous = eventually(answer, "flower to answer", 60, 0.2, until=lambda r: r is not None)
        assert anonymous is not None
        # When it is asked without and with the password; expect 401, then the page
        wrong = httpx.get(url, auth=("ops", "guess"), timeout=5)
        right = httpx.get(url, auth=("ops", password), timeout=5)
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert anonymous.status_code == 401 and wrong.status_code == 401
    assert right.status_code == 200
