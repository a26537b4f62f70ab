"""URL handling shared by every backend: parse once, never show a password."""

from __future__ import annotations

from urllib.parse import SplitResult, urlsplit

from shardkit.errors import ConfigurationError


def redact(url: str) -> str:
    """Return ``url`` with its password replaced by ``***`` (for errors and logs). Never
    raises, whatever the string: a URL too broken to parse is still redacted."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    end = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
    netloc = rest[:end]
    if "@" not in netloc:
        return url
    userinfo, host = netloc.rsplit("@", 1)
    if ":" not in userinfo:
        return url
    user = userinfo.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}{rest[end:]}"


def split(url: str, what: str, *, ports: bool = True) -> SplitResult:
    """``url`` parsed, with its port (if any, and if ``ports``) checked: a malformed URL or
    a port outside 1..65535 is a ``ConfigurationError`` naming the ``what`` URL without
    its password."""
    try:
        parts = urlsplit(url)
        port = parts.port if ports else None
    except ValueError as exc:
        raise ConfigurationError(f"bad {what} URL {redact(url)!r}: {exc}") from None
    if port == 0:
        raise ConfigurationError(f"bad {what} URL {redact(url)!r}: port 0")
    return parts


def scrub(text: str, password: str | None) -> str:
    """Remove ``password`` from a driver's message (drivers may echo connection details)."""
    return text.replace(password, "***") if password else text


def scheme(url: str) -> str:
    """The scheme of ``url`` without a driver suffix: ``postgresql+psycopg`` -> ``postgresql``."""
    return url.partition(":")[0].split("+", 1)[0].lower() if ":" in url else ""
