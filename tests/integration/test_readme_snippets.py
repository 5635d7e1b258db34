"""What the READMEs show runs as shown: the A2A client snippet, a script with its imports, run
by the project's Python against a live API and worker, streams a task to COMPLETED; the
example A2A agent prints where its card is."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
from pathlib import Path

from tests.integration.stack import ROOT, CeleryProcess, ServedApp, free_port

README = ROOT / "README.md"
A2A_AGENT = ROOT / "examples" / "agents" / "a2a" / "agent.py"
STARTUP_BOUND_S = 60  # bounds a hang only


def a2a_snippet() -> str:
    """The first Python block of the README's A2A section."""
    section = README.read_text(encoding="utf-8").split("\n## A2A\n", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert found, "no Python block in the README's A2A section"
    return found.group(1)


def test_the_readme_a2a_client_snippet_runs_as_a_script(
    api: ServedApp, tenant: tuple[str, str], worker: CeleryProcess, tmp_path: Path
) -> None:
    # Given the snippet as a file, pointed at this API (the README names localhost:8000)
    script = tmp_path / "a2a_call.py"
    script.write_text(a2a_snippet().replace('"http://localhost:8000"', repr(api.url)))
    # When it runs with a key in REACH_API_KEY, as the README says
    env = {**os.environ, "REACH_API_KEY": tenant[1]}
    ran = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    # Then it streams the task through to its end
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "TASK_STATE_COMPLETED" in ran.stdout, ran.stdout


def test_the_example_a2a_agent_says_where_its_card_is(tmp_path: Path) -> None:
    # Given the example A2A agent started as the READMEs start it
    port = free_port()
    agent = subprocess.Popen(
        [sys.executable, str(A2A_AGENT), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # When it starts, then its first line is the line the READMEs show
        assert agent.stdout is not None
        # (the old agent printed nothing: bound the wait for a line, not to hang the run)
        printed, _, _ = select.select([agent.stdout], [], [], STARTUP_BOUND_S)
        first = agent.stdout.readline() if printed else "(nothing)"
    finally:
        agent.kill()
        agent.wait(10)
    assert first == f"card at http://127.0.0.1:{port}/.well-known/agent-card.json\n"
