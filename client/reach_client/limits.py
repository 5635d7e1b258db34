"""How much of one answer the client holds: a hostile or broken server that never ends an
answer, a line of an event stream or an event must not make the client grow without end.
Past ``MAX_ANSWER_BYTES`` the client stops reading and raises ``APIConnectionError``
(code ``answer_too_large``)."""

from __future__ import annotations

from reach_client.errors import APIConnectionError

# Far above the server's 4 MiB limit on a result, with its task's envelope around it.
MAX_ANSWER_BYTES = 32 * 1024 * 1024
# The error's code. It is never tried again: the same request would be as large.
TOO_LARGE = "answer_too_large"


def bound(size: int, what: str) -> None:
    """``APIConnectionError`` once ``what`` has grown to ``size`` bytes past the cap."""
    if size > MAX_ANSWER_BYTES:
        raise APIConnectionError(
            f"{what} went past {MAX_ANSWER_BYTES} bytes: the client stopped reading it",
            code=TOO_LARGE,
        )


class Buffer:
    """Bytes that come in pieces, held up to the cap."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._pieces: list[bytes] = []
        self._size = 0

    def add(self, piece: bytes) -> None:
        self._size += len(piece)
        bound(self._size, self._what)
        self._pieces.append(piece)

    def take(self) -> bytes:
        """All the bytes added, which it then forgets."""
        whole = b"".join(self._pieces)
        self._pieces, self._size = [], 0
        return whole
