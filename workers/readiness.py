"""The readiness checks of the capabilities a worker serves: agent code, so each runs on a
thread of its own and is given a bound, never on the lease's thread.

A readiness callable that hung (a dependency that stopped answering, probed without a
timeout of its own) held the lease's thread in the seeds: the lease expired while the worker
went on taking tasks, and the reaper took back each task it ran (a non-idempotent one failed
``worker_lost`` though its run succeeded, an idempotent one ran again). Here a check that
has not answered within ``timeout_s`` counts as not ready, which takes its capability out of
routing as a ``False`` does, and the lease is renewed all the same. A capability whose last
check is still running gets no new one (that round counts as not ready too), so a hung
check ties up one thread, not one per round; the threads are daemons, so one that never
returns does not hold up the worker's exit.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from concurrent.futures import Future, wait

from workers.sdk.agent import CapabilitySpec

log = logging.getLogger("reach.lease")


class ReadinessChecks:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._running: dict[str, Future[bool]] = {}

    def run(self, specs: Iterable[CapabilitySpec]) -> dict[str, bool]:
        """Whether each capability is ready, all checked at once; returns within
        ``timeout_s`` whatever the callables do. One without a callable is ready."""
        outcomes: dict[str, bool] = {}
        started: dict[str, Future[bool]] = {}
        for spec in specs:
            if spec.readiness is None:
                outcomes[spec.name] = True
                continue
            last = self._running.get(spec.name)
            if last is not None and not last.done():
                outcomes[spec.name] = False
                continue
            started[spec.name] = self._running[spec.name] = _start(spec)
        wait(started.values(), timeout=self.timeout_s)
        for name, future in started.items():
            outcomes[name] = _passed(name, future, self.timeout_s)
        return outcomes


def _start(spec: CapabilitySpec) -> Future[bool]:
    future: Future[bool] = Future()
    readiness = spec.readiness
    assert readiness is not None

    def check() -> None:
        future.set_running_or_notify_cancel()
        try:
            future.set_result(bool(readiness()))
        except BaseException as exc:  # reported by ``_passed``
            future.set_exception(exc)

    threading.Thread(target=check, name=f"reach-readiness-{spec.name}", daemon=True).start()
    return future


def _passed(name: str, future: Future[bool], timeout_s: float) -> bool:
    if not future.done():
        log.warning(
            "readiness check of %s did not answer within %.1fs; treating it as not ready",
            name,
            timeout_s,
        )
        return False
    failure = future.exception()
    if failure is not None:
        log.error(
            "readiness check of %s raised; treating it as not ready",
            name,
            exc_info=failure,
        )
        return False
    return future.result()
