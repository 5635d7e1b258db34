"""Reading what a process wrote to a pseudo-terminal, for tests of what users see there."""

from __future__ import annotations

import os


def read_until_closed(controller: int) -> bytes:
    """Everything written to the terminal whose controlling end is ``controller``, until
    every process has closed its end; closes ``controller``."""
    written = bytearray()
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # EIO: the process closed its end
            break
        if not chunk:
            break
        written += chunk
    os.close(controller)
    return bytes(written)
