#!/usr/bin/env python3
"""Run the whole stack: ``python3 scripts/dev.py`` (needs only Python 3.11+)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bootstrap import exec_in_venv

exec_in_venv("embedded", ["-m", "reach.cli", "dev", *sys.argv[1:]])
