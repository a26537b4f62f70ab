"""The kit: one store, one cache, and the counters built on them."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Engine
from sqlalchemy.pool import QueuePool

from shardkit import metrics
from shardkit._program import Blocking
from shardkit.cache import Cache, open_cache
from shardkit.counters import (
    BufferedCounter,
    CounterSettings,
    IdAllocator,
    MonotonicCounter,
    ShardedCounter,
)
from shardkit.counters.base import log
from shardkit.counters.generations import scheduled_flush
from shardkit.errors import (
    ConfigurationError,
    StoreNotFound,
)
from shardkit.executor import Executor, LocalExecutor
from shardkit.kitcore import DEFAULT_CACHE, DEFAULT_STORE, KitCore
from shardkit.mapper.task import TASK
from shardkit.options import KitOptions, counter_options, kit_options
from shardkit.store import Store, open_store
from shardkit.store.sql import SqlStore
from shardkit.validation import check_age, check_job_id, check_mapping

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from shardkit.mapper import Batch, Completion, Job, JobStatus, Mapper


class Kit(KitCore[ShardedCounter, BufferedCounter, MonotonicCounter, IdAllocator], Blocking):
    """A store, a cache and an executor, and the counters that live in them.

    Thread-safe. A kit opened before ``os.fork()`` keeps working in the children: no
    connection is shared across a fork. Use it as a context manager, or ``close()`` it.
    """

    sharded_form = ShardedCounter
    buffered_form = BufferedCounter
    monotonic_form = MonotonicCounter
    ids_form = IdAllocator

    def __init__(
        self, settings: CounterSettings, executor: Executor, secret: str | bytes | None = None
    ) -> None:
        super().__init__(settings)
        self.settings = settings
        """The backends and settings the kit hands its counters."""
        self.store: Store = settings.store
        """The store: the counters' truth (a ``SqlStore``'s ``engine`` is SQLAlchemy's)."""
        self.cache: Cache = settings.cache
        """The cache: shared by the kit's processes, or in-process (``memory://``)."""
        self.executor = executor
        """What runs the kit's background work: flushes, mapping jobs' ranges."""
        self._secret = secret
        self._mapper: Mapper | None = None
        executor.bind(self._tasks(), settings.marks)

    def _tasks(self) -> Mapping[str, Any]:
        """The background tasks counters submit to the executor, by name (JSON args)."""
        return {
            "flush": lambda args: self._carry_out(scheduled_flush(self.settings, args)),
            "flush_all": lambda args: self.flush_all(),
            TASK: lambda args: self.mapper.run_range(args["job"], args["range"]),
        }

    @property
    def mapper(self) -> Mapper:
        """The kit's mapper (its jobs live in the store's ``jobs`` and ``ranges`` tables)."""
        with self._lock:
            if self._mapper is None:
                if not isinstance(self.store, SqlStore):
                    raise ConfigurationError(
                        f"mapping needs a SQL store, not {self.store.url}: the ledger "
                        "and the source share its transactions"
                    )
                from shardkit.mapper.runner import Mapper
                from shardkit.mapper.spec import Signer

                signer = Signer(self._secret) if self._secret else None
                self._mapper = Mapper(self.store, self.executor, signer)
            return self._mapper

    @property
    def namespace(self) -> str:
        """The prefix of every key this kit puts in its cache: ``shardkit:`` and the store's
        identity (see ``Store.identity``), so that stores sharing a cache never meet."""
        return self.settings.namespace

    def __repr__(self) -> str:
        return f"<Kit store={self.store.url} cache={self.cache.url} executor={self.executor.url}>"

    def __enter__(self) -> Kit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the executor (a local one first runs the flushes it has waiting); with a
        private cache, whose contents die with the process, flush the buffered counters
        (folding their generations into one row) and persist the monotonic counters'
        values; then close the connections the kit opened (live engines and clients stay
        open)."""
        self.executor.close()
        self.settings.adjuster.close()
        self._carry_out(self._save_counters())
        self.store.close()
        self.cache.close()

    def map(
        self,
        source: Any,
        fn: Callable[[Batch], object] | str,
        *,
        key: str | Sequence[str] | None = None,
        transactional: bool = False,
        fanout: int = 8,
        page_size: int = 500,
        on_complete: Callable[[Completion], object] | str | None = None,
        retries: int = 5,
        job: str | None = None,
    ) -> Job:
        """Start a job that calls ``fn(batch)`` for every page of ``source``'s rows, in
        parallel on the kit's executor, and return its handle.

        ``source`` is a SQLAlchemy ``Table`` or ``Select`` (read through the store's
        database) or a ``shardkit.mapper.Source``; ``key`` names its unique key column(s)
        (default: a table's primary key). What is left of a range after a full page of
        ``page_size`` rows splits into up to ``fanout`` ranges, cut where the database's
        statistics (its histogram of the key) or key arithmetic aim and placed at real
        keys by index probes — no range is read to plan it; a range planned at a leaf's
        size or less goes on in place: ``rows / workers`` with a local executor (a leaf
        per worker), ``rows / fanout**2`` with another, at least ``fanout`` pages. With
        ``transactional``, ``batch.conn`` is the transaction that commits the page's
        checkpoint: fn's writes through it happen exactly once. Otherwise each page is
        visited at least once. A failing page is retried up to ``retries`` times (a
        range's failures count again from its next page), then the job fails.
        ``on_complete(completion)`` runs once, in the transaction that marks the job
        complete. ``fn`` and ``on_complete`` may be import paths
        (``"package.module:name"``). Starting a ``job`` id that exists resumes that job.
        Bad options raise before anything is written.
        """
        from shardkit.mapper.source import as_source
        from shardkit.mapper.spec import MapSpec, resolve

        check_mapping(page_size, fanout, retries)
        job_id = uuid.uuid4().hex if job is None else check_job_id(job)
        if isinstance(fn, str):
            fn = resolve(fn)
        if isinstance(on_complete, str):
            on_complete = resolve(on_complete)
        if not callable(fn) or (on_complete is not None and not callable(on_complete)):
            raise ConfigurationError("fn and on_complete must be callables or import paths")
        spec = MapSpec(
            source=as_source(source, key),
            fn=fn,
            on_complete=on_complete,
            page_size=page_size,
            fanout=fanout,
            transactional=bool(transactional),
            retries=retries,
        )
        return self.mapper.start(job_id, spec)

    def job(self, job_id: str) -> Job:
        """The handle of job ``job_id``; raises ``JobNotFound`` if there is none."""
        return self.mapper.job(job_id)

    def jobs(self) -> list[JobStatus]:
        """The status of every job in the store, newest first."""
        return self.mapper.statuses()

    def purge_jobs(self, age: float = 7 * 86400.0) -> int:
        """Delete the ledger of the mapping jobs complete or cancelled more than ``age``
        seconds ago (default a week), ranges included; return how many jobs. Failed jobs
        are kept, since they may be resumed. Their ids may then be used again."""
        age = check_age(age)
        return self.mapper.ledger.purge(time.time() - age)


def connect(
    store: str | Engine | Store | None = None,
    cache: str | Cache | Any | None = None,
    *,
    executor: Executor | None = None,
    secret: str | bytes | None = None,
    create: bool = True,
    **options: Unpack[KitOptions],
) -> Kit:
    """Open a kit.

    ``store`` is a URL (default ``$SHARDKIT_STORE`` or ``sqlite:///shardkit.db``), a
    SQLAlchemy ``Engine`` or a ``Store``; ``cache`` a URL (default ``$SHARDKIT_CACHE`` or
    ``memory://``), a live redis-py / pymemcache client or a ``Cache``. Tables are
    created if missing (named with ``prefix``); with ``create=False`` nothing is (to
    read what is there): a store without them, or a SQLite file that does not exist,
    raises ``StoreNotFound`` naming the URL and the prefix. Both backends are reached before this
    returns: an unreachable server raises ``BackendUnavailable`` naming its URL without
    the password. ``executor`` runs background work such as buffered counters' flushes:
    a ``LocalExecutor`` (threads of this process, the default) or a
    ``shardkit.contrib.celery.CeleryExecutor``. ``secret`` (default
    ``$SHARDKIT_SECRET``) signs the pickled closures of mapping jobs. The ``options``
    (``prefix``, ``cache_ttl``, ``max_shards``, ``key_retention``, ``adjust_delay``) are
    ``KitOptions`` (the prefix's default: ``$SHARDKIT_PREFIX``, then ``shardkit_``); a
    bad or unknown one raises ``ConfigurationError`` before anything is opened.

    A store given by URL keeps a connection open for each worker of a local executor,
    and one for the calling thread (at least 5); an ``Engine`` handed in keeps its own
    pool, which should be as large (a smaller one is logged as a warning).
    """
    settled = kit_options(options)
    prefix = settled["prefix"]
    store = store or os.environ.get("SHARDKIT_STORE") or DEFAULT_STORE
    executor = executor or LocalExecutor()
    pool_size = max(5, executor.workers + 1) if isinstance(executor, LocalExecutor) else None
    the_store = open_store(store, prefix=prefix, pool_size=pool_size, existing=not create)
    if isinstance(store, Engine) and pool_size is not None:
        _check_pool(store, pool_size)
    try:
        if create:
            the_store.create_schema()
        elif not the_store.has_schema():
            raise StoreNotFound(
                f"no shardkit tables with the prefix {prefix!r} in {the_store.url}; "
                "nothing was created"
            )
        the_cache = open_cache(cache or os.environ.get("SHARDKIT_CACHE") or DEFAULT_CACHE)
    except BaseException:
        the_store.close()
        raise
    try:
        the_cache.get(f"shardkit:{the_store.identity()}:ping")
    except BaseException:
        the_store.close()
        the_cache.close()
        raise
    return build(the_store, the_cache, executor=executor, secret=secret, **settled)


def _check_pool(engine: Engine, wanted: int) -> None:
    """Warn when a handed-in engine pools fewer connections than the local executor's
    workers and the caller use at once: past the pool, each is reopened for every task."""
    pool = engine.pool
    if isinstance(pool, QueuePool) and pool.size() < wanted:
        log.warning(
            "the store's engine pools %d connections, and the local executor's workers and "
            "the caller use %d at once: the others are opened and closed for every task "
            "(create the engine with pool_size=%d)",
            pool.size(),
            wanted,
            wanted,
        )


def build(
    store: Store,
    cache: Cache,
    *,
    executor: Executor | None = None,
    secret: str | bytes | None = None,
    **options: Unpack[KitOptions],
) -> Kit:
    """A kit on a store and a cache that are open already, with ``connect``'s options.
    Reaches neither: no schema is created and no server is pinged (integrations that
    manage their own schema, such as the Django app, build their kit with this)."""
    settled = counter_options(kit_options(options))
    metrics.start()
    settings = CounterSettings(store=store, cache=cache, **settled)
    return Kit(settings, executor or LocalExecutor(), secret or os.environ.get("SHARDKIT_SECRET"))
