"""Debian's Chromium for the console's browser tests: found, or installed when we can.

Playwright's own browser download cannot work here (only package registries are reached), so
the tests drive ``/usr/bin/chromium``. When it is missing and this process is root with
``apt-get``, it is installed (bounded in time, every command printed); otherwise the caller
is told why not, and decides whether that skips the tests or fails them (CI).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
STEP_TIMEOUT_S = 600


def ensure_chromium(say: Callable[[str], object] = print) -> tuple[Path | None, str]:
    """(the browser's path, "") when it is there or could be installed, else (None, why)."""
    if CHROMIUM.exists():
        return CHROMIUM, ""
    apt = shutil.which("apt-get")
    if apt is None:
        return None, f"{CHROMIUM} is missing and there is no apt-get to install it"
    if os.geteuid() != 0:
        return None, f"{CHROMIUM} is missing; as root: apt-get install -y chromium"
    install = [apt, "install", "-y", "chromium"]
    # The package lists may be missing or stale on a new machine: update once, then retry.
    for steps in ([install], [[apt, "update"], install]):
        if all(_run(step, say) for step in steps) and CHROMIUM.exists():
            return CHROMIUM, ""
    return None, f"installing chromium with apt-get failed: {CHROMIUM} is still missing"


def _run(command: list[str], say: Callable[[str], object]) -> bool:
    say(f"+ {' '.join(command)}  (for the console's browser tests)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        done = subprocess.run(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=STEP_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        say(f"  gave up after {STEP_TIMEOUT_S} s")
        return False
    if done.returncode != 0:
        say(f"  exit {done.returncode}:\n{done.stdout[-2000:]}")
    return done.returncode == 0


if __name__ == "__main__":
    path, why = ensure_chromium()
    print(path or why)
