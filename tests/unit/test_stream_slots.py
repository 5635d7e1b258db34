"""A tenant's stream slots in one API process (``api.sse.StreamSlots``)."""

from __future__ import annotations

import pytest

from api.sse import StreamSlots, TooManyStreams


def test_a_tenant_gets_its_slots_then_a_refusal_and_another_tenant_is_not_touched() -> None:
    slots = StreamSlots(per_tenant=2)
    held = [slots.take("a"), slots.take("a")]
    with pytest.raises(TooManyStreams) as refused:
        slots.take("a")
    assert refused.value.code == "too_many_streams"
    assert refused.value.details == {"limit": 2}
    assert slots.take("b").tenant == "b"
    held[0].release()
    assert slots.take("a").tenant == "a"


def test_a_slot_released_twice_frees_one_place_only() -> None:
    slots = StreamSlots(per_tenant=2)
    first, _ = slots.take("a"), slots.take("a")
    first.release()
    first.release()
    slots.take("a")
    with pytest.raises(TooManyStreams):
        slots.take("a")


def test_a_tenant_with_no_stream_open_leaves_no_entry() -> None:
    slots = StreamSlots(per_tenant=3)
    taken = [slots.take(f"t{i}") for i in range(50)]
    for slot in taken:
        slot.release()
    assert slots.open == {}


def test_leaving_a_with_block_gives_the_slot_back_however_it_is_left() -> None:
    slots = StreamSlots(per_tenant=1)
    with pytest.raises(RuntimeError), slots.take("a"):
        raise RuntimeError("the stream broke")
    with slots.take("a"):
        assert slots.open == {"a": 1}
    assert slots.open == {}
