"""Make ``.venv`` with the project installed, using only the Python that runs this file.

Shared by ``scripts/dev.py`` and ``scripts/test.py``: reinstalls only when a pyproject changed.
The client distribution (``client/``, which owns the ``reach`` command) goes in with the
project, in one pip call: the project depends on it, and no index has it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"


def venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def ensure_venv(extras: str) -> Path:
    if sys.version_info < (3, 11):  # noqa: UP036  (this file runs under any python3)
        sys.exit(f"Agent-Reach needs Python 3.11 or newer; this is {sys.version.split()[0]}")
    if not venv_python().exists():
        print(f"creating {VENV} ...", flush=True)
        venv.create(VENV, with_pip=True)
    manifests = (ROOT / "pyproject.toml", ROOT / "client" / "pyproject.toml")
    wanted = hashlib.sha256(b"".join(m.read_bytes() for m in manifests)).hexdigest()
    # "dev" includes "embedded": either stamp, if current, covers a request for "embedded".
    covering = [extras, "dev"] if extras == "embedded" else [extras]
    if any(_stamp(name).exists() and _stamp(name).read_text() == wanted for name in covering):
        return venv_python()
    print(f"installing agent-reach[{extras}] into {VENV} ...", flush=True)
    pip = [str(venv_python()), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, "setuptools>=77"], check=True)  # the build backend's floor
    subprocess.run([*pip, "-e", str(ROOT / "client"), "-e", f"{ROOT}[{extras}]"], check=True)
    if not _console_script("reach").exists():
        # A venv made before the client owned `reach`: upgrading the project removed the
        # script its old version had, after the client had put its own there.
        subprocess.run([*pip, "--no-deps", "--force-reinstall", "-e", str(ROOT / "client")])
    _stamp(extras).write_text(wanted)
    return venv_python()


def _console_script(name: str) -> Path:
    return (
        VENV
        / ("Scripts" if os.name == "nt" else "bin")
        / (name + (".exe" if os.name == "nt" else ""))
    )


def _stamp(extras: str) -> Path:
    return VENV / f".installed-{extras}"


def exec_in_venv(extras: str, argv: list[str]) -> None:
    python = ensure_venv(extras)
    os.chdir(ROOT)
    os.execv(python, [str(python), *argv])  # noqa: S606
