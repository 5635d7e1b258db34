"""What a server process sets in the interpreter it runs in: the API's and every worker's.

For now, the cyclic garbage collector. CPython collects its youngest generation each time
700 more container objects have been made than freed; every tenth such collection also takes
the middle generation, and every tenth of those, once enough objects have survived, the whole
heap. A worker or an API process with hundreds of tasks or requests in flight keeps each
one's objects alive across several young collections, so they are promoted, and full
collections follow: each one a walk over the whole heap, with the 180,000 objects the
process's libraries left after start-up, 0.1-0.2 s of CPU here.

Measured (``docs/performance.md``, "The garbage collector"): a bridge process making 10,000
calls spent 4.3-4.8 s of its 16-18 s of CPU collecting, and an async worker running the model
phase's 2,000 tasks a quarter of its CPU. With the youngest generation collected every 10,000
net allocations, most objects die before a collection sees them: the same runs spent 0.4-1.0
and 0.37 s, with no full collection.
"""

from __future__ import annotations

import gc

PYTHON_GEN0_THRESHOLD = 700


def tune_collector(gen0_threshold: int) -> None:
    """Collect the youngest generation every ``gen0_threshold`` net allocations of container
    objects (0 leaves the interpreter's own); the older generations' thresholds are kept."""
    if gen0_threshold > 0:
        _, gen1, gen2 = gc.get_threshold()
        gc.set_threshold(gen0_threshold, gen1, gen2)
