"""The readiness checks of the capabilities a worker serves: agent code, so each runs on a
thread of its own, never on the lease's thread, and is waited for a bounded time.

A readiness callable that hung (a dependency that stopped answering, probed without a
timeout of its own) held the lease's thread in the seeds: the lease expired while the worker
went on taking tasks, and the reaper took back each task it ran (a non-idempotent one failed
``worker_lost`` though its run succeeded, an idempotent one ran again). Here each round waits
``wait_s`` at most for the checks it starts, and the lease is renewed all the same.

A check is not cut off by the wait: its answer counts whenever it comes. A capability counts
as its last finished check said (ready until its first one has: it is routed from the worker's
start) while a newer check runs, and as not ready once that check has run longer than
``hang_s`` (the lease's TTL), which takes it out of routing as a ``False`` does. A capability
whose check still runs gets no new one, so a hung check ties up one thread, not one per round;
the threads are daemons, so one that never returns does not hold up the worker's exit. (A
check slower than a renewal interval was once thrown away each round: its capability stayed
out of routing though every answer said ready.)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

from workers.sdk.agent import CapabilitySpec

log = logging.getLogger("reach.lease")


@dataclass
class _Check:
    future: Future[bool]
    started_at: float = field(default_factory=time.monotonic)
    hung: bool = False  # reported as hung


class ReadinessChecks:
    def __init__(self, wait_s: float, hang_s: float) -> None:
        self.wait_s = wait_s
        self.hang_s = hang_s
        self._running: dict[str, _Check] = {}
        self._answers: dict[str, bool] = {}  # each capability's last finished check

    def run(self, specs: Iterable[CapabilitySpec]) -> dict[str, bool]:
        """Whether each capability is ready, starting a check for each whose last one has
        finished; returns within ``wait_s`` whatever the callables do. One without a
        callable is ready."""
        specs = list(specs)
        checked = [spec for spec in specs if spec.readiness is not None]
        started = []
        for spec in checked:
            self._collect(spec.name)
            if spec.name not in self._running:
                self._running[spec.name] = check = _Check(_start(spec))
                started.append(check.future)
        wait(started, timeout=self.wait_s)
        outcomes = {spec.name: True for spec in specs if spec.readiness is None}
        for spec in checked:
            outcomes[spec.name] = self._outcome(spec.name)
        return outcomes

    def _collect(self, name: str) -> None:
        """Keep the answer of ``name``'s check if it has finished, and let it be run again."""
        check = self._running.get(name)
        if check is not None and check.future.done():
            del self._running[name]
            self._answers[name] = _passed(name, check.future)

    def _outcome(self, name: str) -> bool:
        self._collect(name)
        check = self._running.get(name)
        if check is not None and time.monotonic() - check.started_at > self.hang_s:
            if not check.hung:
                check.hung = True
                log.warning(
                    "readiness check of %s has not answered in %.1fs; treating it as not"
                    " ready until it does",
                    name,
                    self.hang_s,
                )
            return False
        return self._answers.get(name, True)


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


def _passed(name: str, future: Future[bool]) -> bool:
    failure = future.exception()
    if failure is not None:
        log.error(
            "readiness check of %s raised; treating it as not ready",
            name,
            exc_info=failure,
        )
        return False
    return future.result()
