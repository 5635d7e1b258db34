#!/usr/bin/env python3
"""Run the checks and the tests: ``python3 scripts/test.py [pytest args]``.

Lint (ruff), types (mypy --strict), layering (import-linter), then pytest against real
Postgres, Redis and Celery workers (local ones when they answer, embedded ones otherwise).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bootstrap import exec_in_venv

exec_in_venv("dev", ["scripts/check_and_test.py", *sys.argv[1:]])
