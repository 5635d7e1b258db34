"""The SSRF guard with the system resolver, which may ask DNS (the guard's rules are
unit-tested with stand-in resolvers in ``tests/unit/test_webhook_ssrf.py``)."""

from __future__ import annotations

import pytest

from broker.webhooks.ssrf import Guard, HostUnresolved


def test_given_a_name_that_does_not_resolve_expect_host_unresolved() -> None:
    with pytest.raises(HostUnresolved):
        Guard([]).check("http://does-not-exist.invalid/h")
