"""Agent addresses: agent ids, versions, channel names, and the envelope's ``target``.

A target names one agent, and a version or a channel of it, in one of three forms:

    <agent_id>@<version>                      invoice-extractor@2.3.1
    <agent_id>@<channel>                      invoice-extractor@canary
    agent://<tenant>/<agent_id>@<selector>    agent://acme/invoice-extractor@stable

What follows the ``@`` is a *version* when it starts with a digit and a *channel* when it
starts with a lowercase letter: versions are ``[0-9][0-9A-Za-z.+_-]{0,63}``, channel names
``[a-z][a-z0-9_-]{0,62}``, so no string is both. The tenant of the long form is only ever
compared with the caller's (an address never reaches across tenants, seed 004's pitfall), so
it is any 1-64 characters but ``/``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

AGENT_ID = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
VERSION = re.compile(r"[0-9][0-9A-Za-z.+_-]{0,63}")
_PARTS = re.compile(r"[0-9]+|[^0-9]+")
CHANNEL = re.compile(r"[a-z][a-z0-9_-]{0,62}")
STABLE = "stable"
SCHEME = "agent://"
TARGET_MAX = 256
# A tenant is any 1-64 printable characters (``key_store``), ``/`` too: the tenant of the long
# form ends at its last ``/``, since no agent id, version or channel holds one.
_TENANT = re.compile(r"[^\x00-\x1f\x7f]{1,64}")
# The grammar above as one pattern, for the OpenAPI document (with TARGET_MAX).
TARGET_PATTERN = (
    rf"^(?:agent://{_TENANT.pattern}/)?{AGENT_ID.pattern}@(?:{VERSION.pattern}|{CHANNEL.pattern})$"
)


class AddressInvalid(ValueError):
    """A target, version or channel name that does not follow the grammar above."""


@dataclass(frozen=True)
class Target:
    agent_id: str
    version: str | None = None
    channel: str | None = None
    tenant: str | None = None  # given only in the ``agent://`` form

    def __str__(self) -> str:
        selector = self.version or self.channel
        short = f"{self.agent_id}@{selector}"
        return f"{SCHEME}{self.tenant}/{short}" if self.tenant is not None else short


def is_version(text: str) -> bool:
    return VERSION.fullmatch(text) is not None


def version_order(version: str) -> tuple[tuple[int, int | str], ...]:
    """A key that orders versions as people read them: each run of digits compared as a
    number, so ``10.0.0`` comes after ``9.1.0`` (as text it came before)."""
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part) for part in _PARTS.findall(version)
    )


def is_channel(text: str) -> bool:
    return CHANNEL.fullmatch(text) is not None


def is_agent_id(text: str) -> bool:
    return AGENT_ID.fullmatch(text) is not None


def parse_target(text: str) -> Target:
    """The target ``text`` names, or AddressInvalid saying which rule it breaks."""
    if len(text) > TARGET_MAX:
        raise AddressInvalid(f"a target is at most {TARGET_MAX} characters")
    tenant = None
    rest = text
    if text.startswith(SCHEME):
        tenant, slash, rest = text[len(SCHEME) :].rpartition("/")
        if not slash or _TENANT.fullmatch(tenant) is None or not tenant.isprintable():
            raise AddressInvalid("agent://<tenant>/<agent_id>@<version|channel>: no tenant")
    agent_id, at, selector = rest.partition("@")
    if not at:
        raise AddressInvalid("a target is <agent_id>@<version> or <agent_id>@<channel>")
    if not is_agent_id(agent_id):
        raise AddressInvalid(
            "the agent id is 1-64 lowercase letters, digits, '-' or '_', starting with a "
            "letter or digit"
        )
    if is_version(selector):
        return Target(agent_id, version=selector, tenant=tenant)
    if is_channel(selector):
        return Target(agent_id, channel=selector, tenant=tenant)
    raise AddressInvalid(
        "after '@' comes a version (starting with a digit: [0-9][0-9A-Za-z.+_-]*) or a "
        "channel name ([a-z][a-z0-9_-]*)"
    )
