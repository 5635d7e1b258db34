"""When a remote agent counts as up, from its health checks, dampened both ways.

The seeds' bug 5.4: an agent that flapped between up and down made a flapping routing table,
which hurt more than the outage. So one failed check only makes the agent ``suspect`` (still
routed, at a lower score); it goes ``offline`` after ``fail_after`` failures in a row. Once
offline it comes back only after ``recover_after_s`` and ``recover_passes`` passes in a row. A
new agent is not routed until its first pass, and ``ready`` at it: there is nothing to dampen
yet.
"""

from __future__ import annotations

from dataclasses import dataclass

from broker.registry.model import OFFLINE, READY, SUSPECT

NEW = "new"


@dataclass(frozen=True)
class Dampening:
    fail_after: int = 5
    recover_passes: int = 5
    recover_after_s: float = 60.0


@dataclass
class Health:
    """One agent's state as its checks have shown it (one per bridge process)."""

    state: str = NEW
    failures: int = 0  # in a row
    passes: int = 0  # in a row
    offline_since: float | None = None

    def observe(self, passed: bool, now: float, policy: Dampening) -> str:
        """Record one check's outcome at ``now`` (seconds, any clock); the state after it."""
        if passed:
            self.failures, self.passes = 0, self.passes + 1
        else:
            self.failures, self.passes = self.failures + 1, 0
        if self.state == OFFLINE:
            if (
                passed
                and self.passes >= policy.recover_passes
                and self.offline_since is not None
                and now - self.offline_since >= policy.recover_after_s
            ):
                self.state, self.offline_since = READY, None
        elif not passed and self.state == NEW:
            pass  # never up yet: nothing to take down, and no wait to serve once it is
        elif not passed and self.failures >= policy.fail_after:
            self.state, self.offline_since = OFFLINE, now
        elif not passed:
            self.state = SUSPECT
        else:
            self.state = READY
        return self.state

    def expired(self, now: float) -> None:
        """The agent's lease ran out (no bridge renewed it): offline, as after failures."""
        if self.state != OFFLINE:
            self.state, self.offline_since, self.passes = OFFLINE, now, 0

    @property
    def routed(self) -> bool:
        return self.state in (READY, SUSPECT)
