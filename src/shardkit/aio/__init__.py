"""shardkit for asyncio: the same counters, awaited, on the same tables and keys.

::

    import shardkit.aio

    async with shardkit.aio.connect(store="postgresql://…", cache="redis://…") as kit:
        views = await kit.sharded("views:home", shards=32)
        await views.incr()
        await views.value()

Every counter kind (``sharded``, ``buffered``, ``monotonic``, ``ids``), ``values``,
``parts``, ``flush_all``, ``purge_keys``, ``get``, and mapping jobs' handles (``job``,
``jobs``: read and waited for; jobs are started with the sync kit). The rules are the
sync kit's own (each is written once, as a program that both kits run: see
``shardkit._program``), so sync and async processes count into the same counters
exactly. Concurrent coroutines writing one counter share statements (or cache
commands), as threads do in the sync kit; buffered counters' flushes are tasks of the
event loop. A kit belongs to the event loop it was opened on.
"""

from __future__ import annotations

import asyncio
import os
import types
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardkit import metrics
from shardkit._program import Awaiting, Clock, arun, playing
from shardkit.aio.adjuster import AsyncAdjuster
from shardkit.aio.cache import OffloadedCache
from shardkit.aio.combine import AsyncCombiner
from shardkit.aio.executor import LoopExecutor
from shardkit.aio.store import AsyncSqlStore, async_engine_from_url
from shardkit.cache import open_kind
from shardkit.cache.memcached import MemcachedCache
from shardkit.cache.memory import MemoryCache
from shardkit.counters.base import Settings
from shardkit.counters.buffered import BufferedCore
from shardkit.counters.generations import scheduled_flush
from shardkit.counters.ids import Guard, IdCore
from shardkit.counters.monotonic import MonotonicCore
from shardkit.counters.sharded import ShardedCore, ShardedRoles, Write, Writes
from shardkit.errors import ShardkitError
from shardkit.kitcore import DEFAULT_CACHE, DEFAULT_STORE, KitCore
from shardkit.mapper.job import Finishes, JobCore, JobRoles
from shardkit.mapper.ledger import JobStatus, job_statuses
from shardkit.mapper.tables import LedgerTables, ledger_tables
from shardkit.options import KitOptions, counter_options, kit_options
from shardkit.store.base import CounterInfo
from shardkit.validation import check_job_id

if TYPE_CHECKING:
    from typing_extensions import Unpack


@dataclass(frozen=True, kw_only=True)
class AsyncSettings(Settings):
    """The backends and settings an async kit hands each of its counters."""

    store: AsyncSqlStore
    cache: Any  # an AsyncRedisCache, an OffloadedCache, or the (never blocking) MemoryCache
    identity: str
    """The store's identity (see ``Store.identity``), read when the kit was opened."""
    adjusting = AsyncAdjuster

    @property
    def namespace(self) -> str:
        return f"shardkit:{self.identity}:"


class AsyncShardedCounter(ShardedCore, Awaiting):
    """``shardkit.ShardedCounter``, awaited: the same guarantees, on the same rows.

    Concurrent increments from coroutines of the kit's event loop are combined: one
    statement (one transaction, with idempotency keys) carries them, and each call
    returns once that has committed. A cancelled (or timed out) call applied or not,
    never half: cancelled while queued, it is not written; cancelled while its batch is
    being written, the write finishes and applies it with the rest (retry it with the
    same ``key`` to make that safe).
    """

    def __init__(self, info: CounterInfo, settings: AsyncSettings) -> None:
        # One batch at a time is written, by the combiner's task: one ticket a process.
        super().__init__(info, settings, types.SimpleNamespace())
        roles, writes = settings.roles, playing(AsyncCombiner(self._write_now), Writes)
        self.roles = ShardedRoles(roles.store, roles.cache, roles.adjuster, writes)

    async def _write_now(self, writes: Sequence[Write]) -> list[bool | ShardkitError]:
        return await self._carry_out(self._write(writes))


class AsyncBufferedCounter(BufferedCore, Awaiting):
    """``shardkit.BufferedCounter``, awaited: the same guarantees, on the same keys and
    rows (a sync process's flush moves an async process's increments, and back).

    Its flushes are tasks of the kit's event loop (``LoopExecutor``). Concurrent
    increments from coroutines share one cache command per side (keyed ones, one of
    their own). A cancelled increment
    counted or not, never half: cancelled while queued, it is not counted; once its
    command is sent, it is.
    """

    _combiner = AsyncCombiner

    async def flush(self) -> int:
        """``BufferedCounter.flush``, once the cache commands being sent have landed (a
        cancelled increment's included): it moves every increment sent before it."""
        await asyncio.gather(*(combiner.settled() for combiner in self._combining))
        return await arun(BufferedCore.flush.program(self), self.roles)


class AsyncMonotonicCounter(MonotonicCore, Awaiting):
    """``shardkit.MonotonicCounter``, awaited: the same guarantees, on the same keys."""


class AsyncIdAllocator(IdCore, Awaiting):
    """``shardkit.IdAllocator``, awaited: ids never handed out twice, from the same
    blocks as the sync kit's (sync and async processes share the allocator)."""

    def __init__(
        self, info: CounterInfo, settings: AsyncSettings, block: int, sub_block: int
    ) -> None:
        clock = playing(asyncio, Clock)
        super().__init__(info, settings, block, sub_block, Guard(asyncio.Lock), clock)


class _Polling:
    """``Finishes`` for an async kit: its jobs run elsewhere, so a waiter polls."""

    def finished(self) -> int:
        return 0

    async def await_finish(self, seen: int, timeout: float) -> int:
        await asyncio.sleep(timeout)
        return seen


class AsyncJob(JobCore, Awaiting):
    """A mapping job's handle in an async kit: its status and its end, read without
    blocking the event loop (start, cancel and resume jobs with the sync kit)."""

    def __init__(self, store: AsyncSqlStore, tables: LedgerTables, job_id: str) -> None:
        super().__init__(store.url, tables, job_id)
        self.roles = JobRoles(store.roles.sql, playing(_Polling(), Finishes))


class AsyncKit(
    KitCore[AsyncShardedCounter, AsyncBufferedCounter, AsyncMonotonicCounter, AsyncIdAllocator],
    Awaiting,
):
    """An async store and cache, and the counters that live in them. Use it as an async
    context manager, or ``await kit.aclose()``."""

    sharded_form = AsyncShardedCounter
    buffered_form = AsyncBufferedCounter
    monotonic_form = AsyncMonotonicCounter
    ids_form = AsyncIdAllocator

    def __init__(self, settings: AsyncSettings) -> None:
        super().__init__(settings)
        self.settings = settings
        """The backends and settings the kit hands its counters."""
        self.store: AsyncSqlStore = settings.store
        """The store: the counters' truth, on SQLAlchemy's asyncio engine."""
        self.cache: Any = settings.cache
        """The cache: shared by the kit's processes, or in-process (``memory://``)."""
        self._has_ledger = False
        self.executor = LoopExecutor(settings.marks)
        """Runs the kit's flushes as tasks of its event loop."""
        self.executor.bind(
            {
                "flush": lambda args: self._carry_out(scheduled_flush(settings, args)),
                "flush_all": lambda args: self.flush_all(),
            }
        )

    def __repr__(self) -> str:
        return f"<AsyncKit store={self.store.url} cache={self.cache.url}>"

    async def __aenter__(self) -> AsyncKit:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Run the flushes waiting in the kit's executor and send the adjustments of
        cached values still gathering; with a private cache, whose contents die with the
        process, flush the buffered counters (folding their generations into one row);
        then close the connections the kit opened."""
        await self.executor.close()
        await self.settings.adjuster.close()
        await self._carry_out(self._save_counters())
        await self.store.close()
        closing = self.cache.close()
        if isinstance(closing, Awaitable):
            await closing

    async def job(self, job_id: str) -> AsyncJob:
        """The handle of mapping job ``job_id``; raises ``JobNotFound`` if there is
        none."""
        job = AsyncJob(self.store, await self._ledger(), check_job_id(job_id))
        await job.status()
        return job

    async def jobs(self) -> list[JobStatus]:
        """The status of every job in the store, newest first."""
        return await arun(job_statuses(await self._ledger()), self.store.roles)

    async def _ledger(self) -> LedgerTables:
        """The mapper's tables, created in the store if missing (looked for once)."""
        tables = ledger_tables(self.store.prefix)
        if not self._has_ledger:
            await self.store.create_tables(tables.metadata, tables.add_missing_columns)
            self._has_ledger = True
        return tables


class _Connecting:
    """What ``connect`` returns: await it for the kit, or use it as ``async with``."""

    def __init__(self, opening: Callable[[], Awaitable[AsyncKit]]) -> None:
        self._opening = opening
        self._kit: AsyncKit | None = None

    def __await__(self) -> Generator[Any, None, AsyncKit]:
        return self._opening().__await__()

    async def __aenter__(self) -> AsyncKit:
        self._kit = await self._opening()
        return self._kit

    async def __aexit__(self, *exc: object) -> None:
        if self._kit is not None:
            await self._kit.aclose()


def connect(
    store: str | None = None,
    cache: str | Any | None = None,
    **options: Unpack[KitOptions],
) -> _Connecting:
    """Open an async kit: ``shardkit.connect``'s store and cache URLs and options (a
    store URL, default ``$SHARDKIT_STORE`` or ``sqlite:///shardkit.db``; a cache URL —
    ``memory://`` or ``redis://…`` — or a live ``redis.asyncio.Redis``, default
    ``$SHARDKIT_CACHE`` or ``memory://``), and ``KitOptions``. Tables are created if
    missing; both backends are reached before the kit is returned. ``await`` it, or
    ``async with`` it (closed on leaving)."""
    settled = kit_options(options)
    metrics.start()
    store_url = store or os.environ.get("SHARDKIT_STORE") or DEFAULT_STORE
    cache_target = cache or os.environ.get("SHARDKIT_CACHE") or DEFAULT_CACHE
    return _Connecting(lambda: _open(store_url, cache_target, settled))


async def _open(store_url: str, cache: Any, options: KitOptions) -> AsyncKit:
    engine = async_engine_from_url(store_url)
    the_store = AsyncSqlStore(engine, prefix=options["prefix"], owns_engine=True)
    the_cache: Any = None
    try:
        await the_store.create_schema()
        identity = await the_store.identity()
        the_cache = _open_cache(cache)
        found = the_cache.get(f"shardkit:{identity}:ping")
        if isinstance(found, Awaitable):
            await found
    except BaseException:
        await the_store.close()
        if the_cache is not None and not isinstance(the_cache, MemoryCache):
            await the_cache.close()
        raise
    settings = AsyncSettings(
        store=the_store, cache=the_cache, identity=identity, **counter_options(options)
    )
    return AsyncKit(settings)


# The class of each kind of cache: the async kit's (memcached's runs in threads).
_CACHES = {
    "cluster": ("shardkit.aio.cluster", "AsyncRedisClusterCache"),
    "redis": ("shardkit.aio.redis", "AsyncRedisCache"),
    "memcached": ("shardkit.cache.memcached", "MemcachedCache"),
}


def _open_cache(target: Any) -> Any:
    """An async kit's cache for a URL, a live ``redis.asyncio`` client or a pymemcache
    client (see ``open_kind``)."""
    cache = open_kind(target, _CACHES, asyncio=True)
    return OffloadedCache(cache) if isinstance(cache, MemcachedCache) else cache


__all__ = [
    "AsyncBufferedCounter",
    "AsyncIdAllocator",
    "AsyncJob",
    "AsyncKit",
    "AsyncMonotonicCounter",
    "AsyncSettings",
    "AsyncShardedCounter",
    "LoopExecutor",
    "connect",
]
