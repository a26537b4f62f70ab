"""The durable store: where counters live. One interface, backends chosen by URL."""

from __future__ import annotations

from sqlalchemy.engine import Engine

from shardkit.errors import ConfigurationError
from shardkit.store.base import CounterInfo, Flushed, Store


def open_store(
    target: str | Engine | Store,
    *,
    prefix: str = "shardkit_",
    pool_size: int | None = None,
    existing: bool = False,
) -> Store:
    """A store for a URL (``sqlite:///…``, ``postgresql://…``, ``mysql://…``), a live
    SQLAlchemy ``Engine``, or an object that already implements ``Store``. A URL's engine
    keeps ``pool_size`` connections open (see ``engine_from_url``); with ``existing``, a
    SQLite file that does not exist raises ``StoreNotFound`` instead of being created."""
    from shardkit.store.sql import SqlStore, engine_from_url

    if isinstance(target, str):
        engine = engine_from_url(target, pool_size=pool_size, existing=existing)
        return SqlStore(engine, prefix=prefix, owns_engine=True)
    if isinstance(target, Engine):
        return SqlStore(target, prefix=prefix)
    if isinstance(target, Store):
        return target
    raise ConfigurationError(f"a store is a URL, an Engine or a Store, not {type(target).__name__}")


__all__ = ["CounterInfo", "Flushed", "Store", "open_store"]
