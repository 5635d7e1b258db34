"""What a receiver or a tenant sends is read without raising, and what a tenant is told of a
host it may not name says nothing of which internal names exist."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from broker.timestamps import parse_retry_after
from broker.webhooks.policy import next_delay_s
from broker.webhooks.ssrf import HostLookups, UrlNotAllowed

SCHEDULE = [0.0, 5.0, 300.0]


@pytest.mark.parametrize(
    "value",
    [
        "\u00b2",  # str.isdigit holds, float refuses it
        "\u0661\u0662",  # Arabic-Indic digits: isdigit holds too
        "Fri, 31 Dec 9999999999999999999 23:59:59 GMT",  # past a C long
    ],
)
def test_a_retry_after_that_is_no_number_nor_a_date_is_ignored(value: str) -> None:
    assert parse_retry_after(value, datetime(2026, 1, 1, tzinfo=UTC)) is None
    assert next_delay_s(SCHEDULE, 1, jitter=0, retry_after_s=parse_retry_after(value)) == 5


def refusal(host: str) -> str:
    lookups = HostLookups(threads=1, timeout_s=10, per_tenant=2)
    try:
        with pytest.raises(UrlNotAllowed) as refused:
            asyncio.run(lookups.vet(f"http://{host}/hook", allow=[], tenant="t-1"))
    finally:
        lookups.close()
    return refused.value.message.replace(host, "<host>")


def test_a_missing_host_and_one_resolving_to_a_refused_address_are_refused_alike() -> None:
    """A tenant told "does not resolve" for one name and "resolves only to addresses that may
    not be reached" for another learnt which internal names exist."""
    missing = refusal("no-such-host.invalid")
    internal = refusal("localhost")  # 127.0.0.1, refused with an empty allow setting
    assert missing == internal
