"""Where the client finds its API: arguments first, then ``REACH_URL`` / ``REACH_API_KEY``,
then a profile of the config file.

The file (``REACH_CONFIG``, else ``$XDG_CONFIG_HOME/reach/config.toml``, else
``~/.config/reach/config.toml``) holds one table per profile; ``REACH_PROFILE`` (or
``profile=``) picks one, ``default`` otherwise::

    [default]
    url = "http://localhost:8000"
    api_key = "rk_..."

    [staging]
    url = "https://reach.staging.example.com"
    api_key = "rk_..."
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from reach_client.errors import ReachError

DEFAULT_URL = "http://localhost:8000"
DEFAULT_PROFILE = "default"


class ConfigurationError(ReachError):
    def __init__(self, detail: str) -> None:
        super().__init__(detail, code="configuration_error")


class NoAPIKeyError(ConfigurationError):
    """No key in the arguments, the environment or the profile file (``config_path``)."""

    def __init__(self, config_path: Path) -> None:
        super().__init__(
            "no API key: pass api_key=, set REACH_API_KEY, or add api_key to a profile in "
            f"{config_path}"
        )
        self.config_path = config_path


@dataclass(frozen=True)
class Config:
    base_url: str
    api_key: str = field(repr=False)


def config_path(env: Mapping[str, str]) -> Path:
    if env.get("REACH_CONFIG"):
        return Path(env["REACH_CONFIG"]).expanduser()
    base = Path(env["XDG_CONFIG_HOME"]) if env.get("XDG_CONFIG_HOME") else Path.home() / ".config"
    return base / "reach" / "config.toml"


def read_profile(path: Path, name: str, *, required: bool) -> dict[str, str]:
    """The profile ``name`` of the file; {} when the file is absent and the name not asked
    for explicitly."""
    if not path.is_file():
        if required:
            raise ConfigurationError(f"profile {name!r} asked for, but {path} does not exist")
        return {}
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigurationError(f"{path}: {exc}") from exc
    profile = document.get(name)
    if profile is None:
        if required:
            raise ConfigurationError(f"{path} has no profile [{name}]")
        return {}
    if not isinstance(profile, dict):
        raise ConfigurationError(f"{path}: [{name}] is not a table")
    return {k: str(v) for k, v in profile.items()}


def resolve(
    base_url: str | None = None,
    api_key: str | None = None,
    profile: str | None = None,
    env: Mapping[str, str] | None = None,
) -> Config:
    """The URL and key to use; ``ConfigurationError`` when no key is found anywhere."""
    env = os.environ if env is None else env
    name = profile or env.get("REACH_PROFILE") or DEFAULT_PROFILE
    explicit = profile is not None or bool(env.get("REACH_PROFILE"))
    from_file = read_profile(config_path(env), name, required=explicit)
    url = base_url or env.get("REACH_URL") or from_file.get("url") or DEFAULT_URL
    # A key given as "" is none given, not a reason to take another from elsewhere.
    key = api_key if api_key is not None else env.get("REACH_API_KEY") or from_file.get("api_key")
    if not key:
        raise NoAPIKeyError(config_path(env))
    return Config(base_url=checked_url(url).rstrip("/"), api_key=checked_key(key))


def checked_key(key: str) -> str:
    """``key`` without the white space around it (a key file's line end, ``$(cat key)``
    leaves a CR), or a ``ConfigurationError`` when it holds a character no key has. The
    error does not quote the key: httpx's refusal of a CR did, whole, on stderr."""
    key = key.strip()
    if not key or not all("!" <= char <= "~" for char in key):
        raise ConfigurationError(
            "the API key holds a character no key has (white space, a control character or "
            "non-ASCII): copy it again as the key's create printed it"
        )
    return key


def checked_url(url: str) -> str:
    """``url`` when it can name the API (``http(s)://host[:port][/path]``), else a
    ``ConfigurationError`` saying why: a typo is the caller's to fix, not a connection to try."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise ConfigurationError(f"the API URL {url!r} is not a URL: {exc}") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ConfigurationError(
            f"the API URL {url!r} names no http(s) host: give it as http://host:port"
        )
    return url
