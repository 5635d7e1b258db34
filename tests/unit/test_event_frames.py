"""A task event as an SSE frame (``Event.sse``) and as stored (``encode``)."""

from __future__ import annotations

import json

from broker.tasks.events import Event, encode, type_of

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


def test_a_stored_events_frame_is_its_stored_json_on_one_line_the_same_event() -> None:
    stored = f'{{"seq":3,{encode("output", {"text": TEXT, "n": 2**70}, "t3")[1:]}'
    event = Event.parse(stored.encode())
    frame = event.sse().decode()
    lines = frame.splitlines()
    assert lines == ["id: 3", "event: output", lines[2], ""]
    built = Event(event.seq, event.type, event.data, event.trace_id, event.at).sse().decode()
    assert json.loads(lines[2].removeprefix("data: ")) == json.loads(
        built.splitlines()[2].removeprefix("data: ")
    )


def test_a_final_event_handed_out_under_another_id_is_written_with_that_id() -> None:
    import dataclasses

    event = Event.parse(f'{{"seq":3,{encode("succeeded", {}, "t4")[1:]}'.encode())
    handed = dataclasses.replace(event, seq=9, stored=None)
    assert json.loads(handed.sse().decode().splitlines()[2].removeprefix("data: "))["seq"] == 9


def test_a_stored_events_type_is_read_from_the_front_of_its_json() -> None:
    for event_type in ("output", "progress", "succeeded"):
        stored = f'{{"seq":12345,{encode(event_type, {"type": "not this"}, "t")[1:]}'
        assert type_of(stored.encode()) == event_type
        assert type_of(stored) == event_type


def test_a_stored_event_of_another_shape_has_its_type_parsed() -> None:
    assert type_of(b'{"data":{"type":"x"},"type":"output","seq":1}') == "output"
    assert type_of(b'{"seq":1,"data":{"type":"x"},"type":"output"}') == "output"
    assert type_of(b'{"seq":1,"type":"outp\\u0075t","data":{}}') == "output"
