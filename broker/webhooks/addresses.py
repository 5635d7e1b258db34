"""Which IP addresses a webhook may never reach: an explicit deny table.

``ipaddress`` alone is not enough on Python 3.11: ``::ffff:127.0.0.1`` is not "loopback",
``64:ff9b::7f00:1`` (NAT64 of 127.0.0.1) is "global", and ``100.64.0.1`` (carrier-grade NAT)
is neither private nor global. So addresses that embed an IPv4 address (IPv4-mapped, NAT64,
6to4) are judged by that IPv4 address, and both the table and ``is_global`` must pass.
"""

from __future__ import annotations

from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address

Address = IPv4Address | IPv6Address

DENIED_V4 = tuple(
    IPv4Network(n)
    for n in (
        "0.0.0.0/8",  # "this network"
        "10.0.0.0/8",  # private
        "100.64.0.0/10",  # carrier-grade NAT
        "127.0.0.0/8",  # loopback
        "169.254.0.0/16",  # link-local, cloud metadata (169.254.169.254)
        "172.16.0.0/12",  # private
        "192.0.0.0/24",  # IETF protocol assignments
        "192.0.2.0/24",  # documentation
        "192.88.99.0/24",  # 6to4 relay anycast
        "192.168.0.0/16",  # private
        "198.18.0.0/15",  # benchmarking
        "198.51.100.0/24",  # documentation
        "203.0.113.0/24",  # documentation
        "224.0.0.0/4",  # multicast
        "240.0.0.0/4",  # reserved
        "255.255.255.255/32",  # broadcast
    )
)

DENIED_V6 = tuple(
    IPv6Network(n)
    for n in (
        "::/96",  # unspecified, loopback, and the deprecated IPv4-compatible form
        "::ffff:0:0:0/96",  # IPv4-translated (SIIT)
        "64:ff9b:1::/48",  # local-use NAT64: its IPv4 side is the operator's own network
        "100::/64",  # discard-only
        "2001::/23",  # IETF protocol assignments, Teredo (2001::/32) among them
        "2001:db8::/32",  # documentation
        "3fff::/20",  # documentation
        "5f00::/16",  # segment routing
        "fc00::/7",  # unique-local
        "fe80::/10",  # link-local
        "fec0::/10",  # site-local (deprecated, still routed by some stacks)
        "ff00::/8",  # multicast
    )
)

# Forms that carry an IPv4 address: they reach whatever that address is.
_MAPPED = IPv6Network("::ffff:0:0/96")
_NAT64 = IPv6Network("64:ff9b::/96")
_SIX_TO_FOUR = IPv6Network("2002::/16")


def embedded_ipv4(address: IPv6Address) -> IPv4Address | None:
    """The IPv4 address an IPv4-mapped, NAT64 or 6to4 address stands for, else None."""
    if address in _MAPPED or address in _NAT64:
        return IPv4Address(int(address) & 0xFFFFFFFF)
    if address in _SIX_TO_FOUR:
        return IPv4Address((int(address) >> 80) & 0xFFFFFFFF)
    return None


def effective(address: Address) -> Address:
    """The address to judge: the embedded IPv4 address when there is one."""
    if isinstance(address, IPv6Address):
        return embedded_ipv4(address) or address
    return address


def is_denied(address: Address | str) -> bool:
    """True for every address a webhook must not reach (see the table)."""
    if isinstance(address, str):
        address = ip_address(address.split("%", 1)[0])
    judged = effective(address)
    table = DENIED_V4 if isinstance(judged, IPv4Address) else DENIED_V6
    if any(judged in network for network in table):
        return True
    # Belt and braces: whatever the standard library knows is not global is refused too.
    return not judged.is_global
