"""The order the loop consumer asks a Redis broker's lists in: kombu's."""

from __future__ import annotations

from workers.loop_consumer import brpop_keys

SEP = "\x06\x16"


def lists_of(*queues: str) -> dict[str, str]:
    """What ``LoopConsumer.consume`` keeps: each list key -> its queue, priority first."""
    return {
        (f"{queue}{SEP}{step}" if step else queue): queue
        for step in (0, 3, 6, 9)
        for queue in sorted(queues)
    }


def test_given_two_queues_expect_each_ones_first_list_before_either_ones_next() -> None:
    keys = lists_of("a", "b")
    assert brpop_keys(keys, ["b", "a"]) == [
        "b",
        "a",
        f"b{SEP}3",
        f"a{SEP}3",
        f"b{SEP}6",
        f"a{SEP}6",
        f"b{SEP}9",
        f"a{SEP}9",
    ]


def test_given_no_queues_expect_no_keys() -> None:
    assert brpop_keys({}, []) == []
