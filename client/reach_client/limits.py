"""How much of one answer the client holds: a hostile or broken server that never ends an
answer, a line of an event stream or an event must not make the client grow without end.
Past ``MAX_ANSWER_BYTES`` (or the client's ``max_answer_bytes``) the client stops reading
and raises ``APIConnectionError`` (code ``answer_too_large``)."""

from __future__ import annotations

from reach_client.errors import APIConnectionError

# Far above the server's 4 MiB limit on a result, with its task's envelope around it.
MAX_ANSWER_BYTES = 32 * 1024 * 1024
# The error's code. It is never tried again: the same request would be as large.
TOO_LARGE = "answer_too_large"


def bound(size: int, what: str, cap: int = MAX_ANSWER_BYTES) -> None:
    """``APIConnectionError`` once ``what`` has grown to ``size`` bytes past ``cap``."""
    if size > cap:
        raise APIConnectionError(
            f"{what} went past {cap} bytes: the client stopped reading it", code=TOO_LARGE
        )


class Buffer:
    """Bytes that come in pieces, held up to the cap."""

    def __init__(self, what: str, cap: int = MAX_ANSWER_BYTES) -> None:
        self._what = what
        self._cap = cap
        self._pieces: list[bytes] = []
        self._size = 0

    def add(self, piece: bytes) -> None:
        self._size += len(piece)
        bound(self._size, self._what, self._cap)
        self._pieces.append(piece)

    def take(self) -> bytes:
        """All the bytes added, which it then forgets."""
        whole = b"".join(self._pieces)
        self._pieces, self._size = [], 0
        return whole
