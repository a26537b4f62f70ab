"""URL handling shared by every backend: parse once, never show a password."""

from __future__ import annotations

from urllib.parse import SplitResult, urlsplit


def redact(url: str) -> str:
    """Return ``url`` with its password replaced by ``***`` (for errors and logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return SplitResult(
        parts.scheme, f"{user}:***@{netloc}", parts.path, parts.query, parts.fragment
    ).geturl()


def scrub(text: str, password: str | None) -> str:
    """Remove ``password`` from a driver's message (drivers may echo connection details)."""
    return text.replace(password, "***") if password else text


def scheme(url: str) -> str:
    """The scheme of ``url`` without a driver suffix: ``postgresql+psycopg`` -> ``postgresql``."""
    return urlsplit(url).scheme.split("+", 1)[0].lower()
