"""The SSRF deny table and the guard: which addresses and URLs a webhook may reach."""

from __future__ import annotations

import pytest

from broker.webhooks.addresses import embedded_ipv4, is_denied
from broker.webhooks.ssrf import Guard, UrlNotAllowed, parse_url

REFUSED = [
    # IPv4: this network, private, carrier-grade NAT, loopback, link-local and metadata
    "0.0.0.0",
    "0.1.2.3",
    "10.0.0.1",
    "10.255.255.255",
    "100.64.0.1",
    "100.127.255.254",
    "127.0.0.1",
    "127.255.255.254",
    "169.254.169.254",
    "169.254.0.1",
    "172.16.0.1",
    "172.31.255.255",
    "192.168.1.1",
    # IETF, documentation, benchmarking, 6to4 relay, multicast, reserved, broadcast
    "192.0.0.1",
    "192.0.0.170",
    "192.0.2.1",
    "192.88.99.1",
    "198.18.0.1",
    "198.19.255.255",
    "198.51.100.7",
    "203.0.113.9",
    "224.0.0.1",
    "239.255.255.250",
    "240.0.0.1",
    "255.255.255.255",
    # IPv6: unspecified, loopback, unique-local, link-local, site-local, multicast, docs
    "::",
    "::1",
    "fc00::1",
    "fd00:ec2::254",  # AWS's IPv6 metadata address
    "fe80::1",
    "fec0::1",
    "ff02::1",
    "2001:db8::1",
    "3fff::1",
    "100::1",
    "2001::1",  # Teredo
    "2001:10::1",
    "5f00::1",
    "64:ff9b:1::a00:1",  # local-use NAT64
    # IPv4 inside IPv6, judged by the IPv4 address
    "::ffff:127.0.0.1",
    "::ffff:7f00:1",
    "::ffff:10.0.0.1",
    "::ffff:169.254.169.254",
    "::ffff:100.64.0.1",
    "64:ff9b::7f00:1",  # NAT64 of 127.0.0.1
    "64:ff9b::a9fe:a9fe",  # NAT64 of 169.254.169.254
    "64:ff9b::a00:1",
    "2002:7f00:1::1",  # 6to4 of 127.0.0.1
    "2002:a9fe:a9fe::",  # 6to4 of 169.254.169.254
    "::127.0.0.1",  # IPv4-compatible (deprecated)
    "::ffff:0:7f00:1",  # IPv4-translated
]

ALLOWED = [
    "8.8.8.8",
    "1.1.1.1",
    "93.184.215.14",
    "100.63.255.255",  # just below carrier-grade NAT
    "100.128.0.0",  # just above it
    "172.15.255.255",
    "172.32.0.1",
    "192.169.0.1",
    "198.17.255.255",
    "223.255.255.254",
    "2606:4700:4700::1111",
    "2001:4860:4860::8888",
    "2a00:1450:4001::200e",
    "::ffff:8.8.8.8",  # mapped public address
    "64:ff9b::808:808",  # NAT64 of 8.8.8.8: how IPv6-only networks reach IPv4
    "2002:808:808::1",  # 6to4 of 8.8.8.8
]


@pytest.mark.parametrize("address", REFUSED)
def test_refused_address(address: str) -> None:
    assert is_denied(address)


@pytest.mark.parametrize("address", ALLOWED)
def test_allowed_address(address: str) -> None:
    assert not is_denied(address)


def test_mapped_nat64_and_6to4_forms_carry_their_ipv4_address() -> None:
    from ipaddress import IPv4Address, IPv6Address

    for form in ("::ffff:127.0.0.1", "64:ff9b::7f00:1", "2002:7f00:1::5"):
        assert embedded_ipv4(IPv6Address(form)) == IPv4Address("127.0.0.1")
    assert embedded_ipv4(IPv6Address("2606:4700::1")) is None


# --- the allow setting ------------------------------------------------------------------


def test_given_an_allowed_address_expect_it_and_its_mapped_form_pass_and_no_other() -> None:
    guard = Guard(["127.0.0.1"])
    assert guard.address_allowed("127.0.0.1")
    assert guard.address_allowed("::ffff:127.0.0.1")
    assert not guard.address_allowed("127.0.0.2")
    assert not guard.address_allowed("::1")
    assert not guard.address_allowed("10.0.0.1")


def test_given_an_allowed_network_expect_every_address_in_it_passes() -> None:
    guard = Guard(["10.1.0.0/16", "::1"])
    assert guard.address_allowed("10.1.200.3")
    assert not guard.address_allowed("10.2.0.1")
    assert guard.address_allowed("::1")


def test_given_an_allowed_host_name_expect_it_passes_whatever_it_resolves_to() -> None:
    guard = Guard(["receiver.internal"], resolver=lambda host, port: ["10.9.8.7"])
    assert guard.check("http://receiver.internal/h").addresses == ("10.9.8.7",)
    with pytest.raises(UrlNotAllowed):
        guard.check("http://other.internal/h")


def test_given_no_allow_setting_expect_loopback_refused() -> None:
    guard = Guard([], resolver=lambda host, port: ["127.0.0.1"])
    with pytest.raises(UrlNotAllowed):
        guard.check("http://localhost:8000/h")


# --- resolving ----------------------------------------------------------------------------


def test_given_mixed_answers_expect_only_public_addresses_kept() -> None:
    guard = Guard([], resolver=lambda host, port: ["10.0.0.1", "93.184.215.14", "::1"])
    assert guard.check("https://example.com/h").addresses == ("93.184.215.14",)


def test_given_the_port_expect_it_passed_to_the_resolver() -> None:
    asked: list[tuple[str, int]] = []

    def resolver(host: str, port: int) -> list[str]:
        asked.append((host, port))
        return ["93.184.215.14"]

    Guard([], resolver=resolver).check("https://Example.COM/h")
    Guard([], resolver=resolver).check("http://example.com:8080/h")
    assert asked == [("example.com", 443), ("example.com", 8080)]


@pytest.mark.parametrize(
    "url",
    [
        "http://2130706433/",  # 127.0.0.1 as one number
        "http://0x7f.1/",
        "http://127.1/",
        "http://localhost/",
        "http://[::ffff:127.0.0.1]/",
        "http://[::1]/",
        "http://169.254.169.254/latest/meta-data/",
    ],
)
def test_given_loopback_and_metadata_in_any_spelling_expect_refused(url: str) -> None:
    with pytest.raises(UrlNotAllowed):
        Guard([]).check(url)


# --- URL form -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "ftp://example.com/h",
        "file:///etc/passwd",
        "gopher://example.com/",
        "javascript:alert(1)",
        "http://user:pass@example.com/h",
        "http://user@example.com/h",
        "http://example.com\\@127.0.0.1/",
        "http://exa mple.com/",
        "http://example.com/\r\nX: y",
        "http:///nohost",
        "http://[fe80::1%25eth0]/",
        "https://" + "a" * 2100 + ".com/",
        # ports httpx takes but no connection should: past 65535 (one client wrapped it to
        # 44057), signed, in another script's digits, zero, empty
        "http://127.0.0.1:109593/hook",
        "http://example.com:+44057/h",
        "http://example.com:\u0664\u0664\u0660\u0665\u0667/h",
        "http://example.com:0/h",
        "http://example.com:/h",
    ],
)
def test_refused_url_forms(url: str) -> None:
    with pytest.raises(UrlNotAllowed):
        parse_url(url)


@pytest.mark.parametrize(
    "url",
    [
        "https://example.com/hooks/reach",
        "http://example.com:8080/h?x=1",
        "https://bücher.de/h",
        "http://[::1]:65535/h",
        "http://[2001:db8::1]/h",
    ],
)
def test_accepted_url_forms(url: str) -> None:
    assert parse_url(url).scheme in ("http", "https")
