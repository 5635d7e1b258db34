"""The order the loop consumer asks a Redis broker's lists in: kombu's."""

from __future__ import annotations

from broker.tasks.dispatch import TENANT_HEADER
from workers.loop_consumer import brpop_keys, share_cap, tenant_of

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


# -- a tenant's share of a process's slots (``share_cap``, ``tenant_of``) ---------------------


def test_given_the_default_share_expect_a_tenth_of_the_slots_kept_for_the_other_tenants() -> None:
    assert share_cap(500, 0.9) == 450
    assert share_cap(1000, 0.9) == 900
    assert share_cap(10, 0.9) == 9


def test_given_few_slots_expect_the_share_rounded_up_and_at_least_one() -> None:
    assert share_cap(2, 0.9) == 2  # below 10 slots, 0.9 keeps none back
    assert share_cap(4, 0.5) == 2
    assert share_cap(3, 0.5) == 2
    assert share_cap(1, 0.1) == 1
    assert share_cap(500, 1.0) == 500


def test_given_a_run_message_expect_its_tenant_from_the_broker_header() -> None:
    assert tenant_of({TENANT_HEADER: "acme", "trace_id": "t"}) == "acme"


def test_given_no_tenant_or_one_not_a_name_expect_it_counted_for_nobody() -> None:
    assert tenant_of({}) is None
    assert tenant_of({TENANT_HEADER: ""}) is None
    assert tenant_of({TENANT_HEADER: ["acme"]}) is None


def test_given_a_countdown_expect_it_counted_for_nobody_celerys_timer_holds_it() -> None:
    assert tenant_of({TENANT_HEADER: "acme", "eta": "2026-12-06T14:00:00+00:00"}) is None
