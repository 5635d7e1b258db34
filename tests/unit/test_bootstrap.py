"""``scripts/bootstrap.py``, which makes ``.venv`` for the run and test commands: here on a
venv of the test's own, with pip and venv creation stood in for where they would install."""

from __future__ import annotations

import hashlib
import importlib.util
import subprocess
import sys
import venv
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bootstrap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The script's module, making its venv in ``tmp_path/.venv``."""
    spec = importlib.util.spec_from_file_location("bootstrap", ROOT / "scripts" / "bootstrap.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "VENV", tmp_path / ".venv")
    return module


def _current_stamp(bootstrap: ModuleType, extras: str) -> None:
    manifests = (ROOT / "pyproject.toml", ROOT / "client" / "pyproject.toml")
    wanted = hashlib.sha256(b"".join(m.read_bytes() for m in manifests)).hexdigest()
    (bootstrap.VENV / f".installed-{extras}").write_text(wanted)


def test_a_venv_whose_python_cannot_import_pip_is_made_again(
    bootstrap: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # given a venv whose ensurepip never ran (Ctrl-C, or Debian without python3-venv), its
    # install stamp current
    venv.create(bootstrap.VENV, with_pip=False)
    _current_stamp(bootstrap, "embedded")
    made: list[dict[str, Any]] = []
    monkeypatch.setattr(bootstrap.venv, "create", lambda path, **kw: made.append(kw))
    # when the next run asks for it
    bootstrap.ensure_venv("embedded")
    # expect it made again with pip, its files (the stamp among them) gone first
    assert made == [{"with_pip": True, "clear": True}]


def test_a_failed_ensurepip_ends_in_one_line_naming_the_package_to_install(
    bootstrap: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # given a Python whose ensurepip fails, as Debian's does without python3-venv
    def create(path: Path, **kw: object) -> None:
        raise subprocess.CalledProcessError(1, ["python", "-m", "ensurepip"])

    monkeypatch.setattr(bootstrap.venv, "create", create)
    # when a first run makes the venv
    with pytest.raises(SystemExit) as exited:
        bootstrap.ensure_venv("embedded")
    # expect one line saying what to install, no traceback
    message = str(exited.value.code)
    assert "\n" not in message
    assert f"apt install python{sys.version_info[0]}.{sys.version_info[1]}-venv" in message


def test_a_failed_reinstall_of_the_client_fails_the_install_and_writes_no_stamp(
    bootstrap: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # given a venv without the `reach` script, where reinstalling the client fails
    (bootstrap.VENV / "bin").mkdir(parents=True)
    (bootstrap.VENV / "bin" / "python").touch()

    def run(argv: list[str], check: bool = False, **kw: object) -> subprocess.CompletedProcess[str]:
        code = 1 if "--force-reinstall" in argv else 0
        if check and code:
            raise subprocess.CalledProcessError(code, argv)
        return subprocess.CompletedProcess(argv, code)

    monkeypatch.setattr(bootstrap.subprocess, "run", run)
    # when the project is installed
    with pytest.raises(subprocess.CalledProcessError):
        bootstrap.ensure_venv("embedded")
    # expect no stamp: the next run tries again
    assert not (bootstrap.VENV / ".installed-embedded").exists()


def test_on_python_3_13_a_python3_12_or_3_11_on_path_makes_the_venv(
    bootstrap: ModuleType,
) -> None:
    # given the pythons on PATH
    both = {"python3.12": "/usr/bin/python3.12", "python3.11": "/opt/bin/python3.11"}.get
    only_311 = {"python3.11": "/opt/bin/python3.11"}.get
    pick = bootstrap.python_with_embedded_wheels
    # expect the newest with the embedded services' wheels, on 3.13 and later only
    assert pick((3, 13), both) == "/usr/bin/python3.12"
    assert pick((3, 14), only_311) == "/opt/bin/python3.11"
    assert pick((3, 13), lambda name: None) is None
    assert pick((3, 12), both) is None


def test_on_python_3_13_the_run_goes_on_under_the_older_python(
    bootstrap: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # given no venv yet, and a python3.12 on PATH
    monkeypatch.setattr(bootstrap, "python_with_embedded_wheels", lambda: "/usr/bin/python3.12")
    ran: list[list[str]] = []

    def execv(path: str, argv: list[str]) -> None:
        ran.append(argv)
        raise SystemExit(0)  # execv does not return

    monkeypatch.setattr(bootstrap.os, "execv", execv)
    # when a run starts
    with pytest.raises(SystemExit):
        bootstrap.ensure_venv("embedded")
    # expect the same command run again by that python, before any venv is made
    assert ran == [["/usr/bin/python3.12", *sys.argv]]
    assert not bootstrap.VENV.exists()
