"""Inside the venv: static checks first (fast failures), then the test suite."""

import subprocess
import sys
from pathlib import Path

from chromium import ensure_chromium

BIN = Path(sys.executable).parent
CHECKS = [
    [str(BIN / "ruff"), "check", "."],
    [str(BIN / "ruff"), "format", "--check", "."],
    [str(BIN / "mypy"), "broker", "workers", "api", "reach", "client/reach_client", "bench"],
    [str(BIN / "lint-imports")],
]

for check in CHECKS:
    print(
        "+", " ".join(Path(check[0]).name if i == 0 else a for i, a in enumerate(check)), flush=True
    )
    if subprocess.run(check).returncode != 0:
        sys.exit(1)
# Before pytest (whose per-test timeout an install could outlast): the browser tests need it.
browser, why_not = ensure_chromium()
print(f"+ chromium: {browser or why_not}", flush=True)
sys.exit(subprocess.run([sys.executable, "-m", "pytest", *sys.argv[1:]]).returncode)
