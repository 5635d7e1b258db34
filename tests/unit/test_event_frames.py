"""A task event as an SSE frame (``Event.sse``) and as stored (``encode``)."""

from __future__ import annotations

import json

from broker.tasks.events import Event, encode

TEXT = "a\u2028b\u2029c\x85d\x0be\nf\rg é ✓"


def test_a_frames_data_is_one_line_whatever_its_text_holds() -> None:
    event = Event(seq=7, type="output", data={"text": TEXT, "n": 2**70}, trace_id="t1", at=1.5)
    frame = event.sse().decode()
    lines = frame.splitlines()  # Python's rule, as httpx's iter_lines (and our client) read
    assert lines == [lines[0], lines[1], lines[2], ""]
    assert lines[:2] == ["id: 7", "event: output"]
    assert json.loads(lines[2].removeprefix("data: ")) == {
        "seq": 7,
        "type": "output",
        "trace_id": "t1",
        "at": 1.5,
        "data": {"text": TEXT, "n": 2**70},
    }
    assert "é ✓" in frame  # the rest stays UTF-8


def test_a_stored_event_reads_back_as_written() -> None:
    stored = encode("progress", {"n": 2**70, "text": TEXT}, "t2")
    event = Event.parse(f'{{"seq":3,{stored[1:]}')
    assert (event.seq, event.type, event.trace_id) == (3, "progress", "t2")
    assert event.data == {"n": 2**70, "text": TEXT}
