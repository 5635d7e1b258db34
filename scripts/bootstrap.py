"""Make ``.venv`` with the project installed, using only the Python that runs this file.

Shared by ``scripts/dev.py`` and ``scripts/test.py``: reinstalls only when pyproject changed.
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
    stamp = VENV / f".installed-{extras}"
    wanted = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if not stamp.exists() or stamp.read_text() != wanted:
        print(f"installing agent-reach[{extras}] into {VENV} ...", flush=True)
        pip = [str(venv_python()), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        subprocess.run([*pip, "--upgrade", "pip", "setuptools>=77"], check=True)
        subprocess.run([*pip, "-e", f"{ROOT}[{extras}]"], check=True)
        stamp.write_text(wanted)
    return venv_python()


def exec_in_venv(extras: str, argv: list[str]) -> None:
    python = ensure_venv(extras)
    os.chdir(ROOT)
    os.execv(python, [str(python), *argv])  # noqa: S606
