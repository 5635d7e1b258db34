"""One phase of ``python -m bench`` run by itself (``python -m bench.model``,
``python -m bench.remote``), on fresh stores, at the full run's size or the CI's."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from tempfile import mkdtemp
from typing import Any

from bench.environment import Stores, fresh_stores
from bench.machine import Meter, loop_s, speed_line
from bench.plan import Plan, full, quick
from bench.processes import Children

Measure = Callable[[Stores, Children, Plan, Callable[[str], None], Meter], dict[str, Any]]


def run(
    argv: list[str] | None,
    *,
    key: str,
    description: str | None,
    measure: Measure,
    title: Callable[[Plan], str],
    table: Callable[[dict[str, Any]], str],
) -> int:
    """Parse ``--quick``, measure the phase into ``{key: figures}`` and print its table."""
    parser = argparse.ArgumentParser(prog=f"python -m bench.{key}", description=description)
    parser.add_argument("--quick", action="store_true", help="the CI size")
    args = parser.parse_args(argv)
    plan = quick() if args.quick else full()
    started_s = loop_s()
    with fresh_stores() as stores, Children(Path(mkdtemp(prefix=f"bench-{key}-"))) as children:
        result = {key: measure(stores, children, plan, progress, Meter())}
    print(title(plan))
    print(table(result))
    print(speed_line(started_s, loop_s()))
    return 0


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
