"""Ids that must be unique, not secret: a webhook message's id, a span's.

They are drawn from a Mersenne Twister of their own (reseeded from the OS in a forked child),
not ``os.urandom``: its system call lets go of the GIL, and on a bridge's event loop, with
other threads in the process, each such call handed the GIL to one of them and waited to get
it back, twice a call (``docs/performance.md``, "Ids without the GIL"). Its own generator, so
that what it draws says nothing of the draws of ``random`` elsewhere (the routing's). Nothing
a caller sees is made here (trace ids, task ids), and nothing secret: keys and secrets come
from ``secrets``.
"""

from __future__ import annotations

import os
import random

_draws = random.Random()
os.register_at_fork(after_in_child=_draws.seed)


def unique_hex(bits: int) -> str:
    """``bits`` random bits as ``bits / 4`` lowercase hex digits, never all zero (W3C
    forbids a zero span id)."""
    return f"{_draws.getrandbits(bits) or 1:0{bits // 4}x}"
