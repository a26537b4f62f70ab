"""What a job runs, in a form another process (a Celery worker) can rebuild.

A job's functions travel by import path (``"package.module:function"``): a module-level
function is recognised as one. Anything else (a closure, a lambda, a ``Select``) travels
only as a cloudpickle payload signed with HMAC-SHA256 under the kit's secret, and a
payload whose signature does not match is rejected before it is unpickled: whoever can
write to the store cannot make a worker run their code without the secret.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from shardkit.errors import ConfigurationError, MissingDriver, UntrustedPayload
from shardkit.mapper.source import Source, TableSource


def reference(obj: Any) -> str | None:
    """The import path of ``obj`` if importing that path gives ``obj`` back, else None.
    A string is taken as an import path."""
    if isinstance(obj, str):
        return obj
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not name or "<" in name or module == "__main__":
        return None
    path = f"{module}:{name}"
    try:
        found = resolve(path)
    except ConfigurationError:
        return None
    return path if found is obj else None


def resolve(path: str) -> Any:
    """The object at ``"module:attribute.path"``; ``ConfigurationError`` if there is none."""
    module_name, sep, attributes = path.partition(":")
    if not sep or not module_name or not attributes:
        raise ConfigurationError(f"an import path looks like 'package.module:name', not {path!r}")
    try:
        found: Any = importlib.import_module(module_name)
        for attribute in attributes.split("."):
            found = getattr(found, attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"cannot import {path!r}: {exc}") from exc
    return found


class Signer:
    """Signs and verifies pickled payloads with HMAC-SHA256 under a secret."""

    def __init__(self, secret: str | bytes) -> None:
        if not secret:
            raise ConfigurationError("a signing secret must not be empty")
        self._key = secret.encode() if isinstance(secret, str) else secret

    def __repr__(self) -> str:
        return "<Signer>"  # never the secret

    def dumps(self, obj: Any) -> str:
        """``obj`` cloudpickled, signed, as text."""
        payload = _cloudpickle().dumps(obj)
        signature = hmac.new(self._key, payload, hashlib.sha256).digest()
        return base64.b64encode(signature + payload).decode()

    def loads(self, text: str) -> Any:
        """The object signed by ``dumps``; ``UntrustedPayload`` — before unpickling
        anything — if the signature does not match."""
        try:
            raw = base64.b64decode(text, validate=True)
        except ValueError as exc:
            raise UntrustedPayload("a job payload is not base64") from exc
        signature, payload = raw[:32], raw[32:]
        expected = hmac.new(self._key, payload, hashlib.sha256).digest()
        if len(signature) != 32 or not hmac.compare_digest(signature, expected):
            raise UntrustedPayload("a job payload's signature does not match the kit's secret")
        return _cloudpickle().loads(payload)


def _cloudpickle() -> Any:
    try:
        import cloudpickle
    except ImportError as exc:
        raise MissingDriver(
            "closures travel as cloudpickle payloads: pip install 'shardkit[celery]'"
        ) from exc
    return cloudpickle


Fn = Callable[[Any], object]


@dataclass(frozen=True)
class MapSpec:
    """A job's source, functions and options."""

    source: Source
    fn: Fn
    on_complete: Fn | None
    page_size: int
    fanout: int
    transactional: bool
    retries: int

    def dumps(self, signer: Signer | None) -> tuple[str, list[str]]:
        """The spec as JSON text, and the parts left out of it: those neither importable
        nor portable when there is no ``signer`` to sign them pickled."""
        parts: dict[str, Any] = {}
        pickled: dict[str, Any] = {}
        for name, value in (("fn", self.fn), ("on_complete", self.on_complete)):
            path = None if value is None else reference(value)
            parts[name] = path
            if value is not None and path is None:
                pickled[name] = value
        parts["source"] = self.source.portable()
        if parts["source"] is None:
            pickled["source"] = self.source
        missing = sorted(pickled) if signer is None else []
        text = json.dumps(
            {
                **parts,
                "pickled": signer.dumps(pickled) if pickled and signer else None,
                "missing": missing,
                "page_size": self.page_size,
                "fanout": self.fanout,
                "transactional": self.transactional,
                "retries": self.retries,
            }
        )
        return text, missing

    @classmethod
    def loads(cls, text: str, engine: sa.Engine, signer: Signer | None) -> MapSpec:
        """Rebuild a spec from ``dumps``: import what travels by path, verify and unpickle
        what travels signed. ``ConfigurationError`` if a part was left out."""
        data = json.loads(text)
        if data["missing"]:
            raise ConfigurationError(
                f"this job's {', '.join(data['missing'])} cannot be rebuilt in another "
                "process: use importable functions, or give the kit a secret so closures "
                "travel signed"
            )
        pickled: dict[str, Any] = {}
        if data["pickled"] is not None:
            if signer is None:
                raise ConfigurationError("this job's payload is signed: give the kit its secret")
            pickled = signer.loads(data["pickled"])
        fn = pickled.get("fn") or resolve(data["fn"])
        if data["on_complete"] is not None:
            on_complete = resolve(data["on_complete"])
        else:
            on_complete = pickled.get("on_complete")
        if data["source"] is not None:
            source: Source = TableSource.load(data["source"], engine)
        else:
            source = pickled["source"]
        return cls(
            source=source,
            fn=fn,
            on_complete=on_complete,
            page_size=int(data["page_size"]),
            fanout=int(data["fanout"]),
            transactional=bool(data["transactional"]),
            retries=int(data["retries"]),
        )


__all__ = ["MapSpec", "Signer", "reference", "resolve"]
