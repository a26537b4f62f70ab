"""The fixtures every test can use: each store and cache (real services, see
``support/backends.py``), kits on them, and the per-worker throwaway servers.

Tests run in parallel (pytest-xdist, configured in ``pyproject.toml``); every worker is a
process of its own with its own table prefix and cache namespace (``backends.PREFIX``)
and its own throwaway servers, started once and reused.
"""

from __future__ import annotations

import gc
import os
import uuid
import zlib
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import Phase, settings

import shardkit
from backends import (
    CACHE_URLS,
    CLUSTER,
    PREFIX,
    REDIS,
    STORE_URLS,
    Target,
    _used_stores,
    cache_url_of,
    drop_tables,
    require,
    store_url_for,
)
from shardkit.cache import Cache, open_cache
from shardkit.store import Store, open_store

if TYPE_CHECKING:
    from servers import Cutter


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: two workers a core (most tests wait on servers and child processes),
    or ``$PYTEST_XDIST_AUTO_NUM_WORKERS``."""
    given = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    return int(given) if given else 2 * (os.cpu_count() or 1)


# The caches of the cache fixtures' params, in the order a heavy test's pairs take them.
_CACHES = [*CACHE_URLS, CLUSTER]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test marked ``pairs`` runs each store once and each cache once, not every pair:
    the store of its ``k``-th cache is the ``(k + turn)``-th, where ``turn`` comes from
    the test's name, so that the marked tests together still run every pair."""
    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        (kept if _runs_its_pair(item) else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def _runs_its_pair(item: pytest.Item) -> bool:
    if item.get_closest_marker("pairs") is None or not isinstance(item, pytest.Function):
        return True
    params: dict[str, Any] = item.callspec.params
    store = next(value for key, value in params.items() if key in ("store_url", "store"))
    cache = next(value for key, value in params.items() if key.endswith("cache_url"))
    stores = list(STORE_URLS)
    turn = zlib.crc32(item.originalname.encode())
    return stores.index(store) == (_CACHES.index(cache) + turn) % len(stores)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    _freeze_the_heap()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, object, object]:
    """After a module's last test (its fixtures torn down), ``_freeze_the_heap``."""
    ran = yield
    if nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None):
        _freeze_the_heap()
    return ran


def _freeze_the_heap() -> None:
    """Collect, then leave what survives out of every later collection (``gc.freeze``):
    the imports, servers and caches of a worker that has run many tests. The collector's
    passes, the automatic ones and a test's own ``gc.collect()``, then go over what the
    tests since made, not the worker's whole heap (a pass over it took a second). A
    test's own objects are never frozen while it runs: whether one is collected is
    seen as without it."""
    gc.collect()
    gc.freeze()


# Every run draws the same examples: a failure is one that the next run shows again.
# HYPOTHESIS_PROFILE=explore draws new ones (and keeps failing examples in .hypothesis/).
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False)
# tools/mutate.py: the ci profile's examples, a failure reported as found (a mutant is
# killed by any failing example; shrinking it would only spend the run's time).
settings.register_profile(
    "mutation", settings.get_profile("ci"), phases=[Phase.explicit, Phase.generate], deadline=None
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Every kit of the tests records metrics (so every test runs the instrumented paths), in
# this process and in the processes it starts, as wherever prometheus_client is
# installed; "on" makes a missing one an error.
os.environ["SHARDKIT_METRICS"] = "on"


@pytest.fixture(scope="session")
def sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    path: Path = tmp_path_factory.mktemp("sqlite") / "shardkit.db"
    return f"sqlite:///{path}"


@pytest.fixture(scope="session", autouse=True)
def _drop_session_tables() -> Iterator[None]:
    yield
    drop_tables(_used_stores, PREFIX)


@pytest.fixture(params=list(STORE_URLS))
def store_url(request: pytest.FixtureRequest, sqlite_url: str) -> str:
    return store_url_for(request.param, sqlite_url)


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[Any]:
    """A Redis Cluster of the session's own, started on first use."""
    from servers import RedisClusterServers, running

    with running(RedisClusterServers) as cluster:
        yield cluster


@pytest.fixture(params=[*CACHE_URLS, CLUSTER])
def cache_url(request: pytest.FixtureRequest) -> str:
    return cache_url_of(request, request.param)


@pytest.fixture(
    params=[*STORE_URLS, pytest.param("django", marks=pytest.mark.django_db(transaction=True))]
)
def store(request: pytest.FixtureRequest, sqlite_url: str) -> Iterator[Store]:
    """Every store: the SQL ones by URL, and the Django app's on the example site's
    SQLite test database (migrated by pytest-django)."""
    if request.param == "django":
        from shardkit.contrib.django.store import DjangoStore

        the_store: Store = DjangoStore("default")
    else:
        the_store = open_store(store_url_for(request.param, sqlite_url), prefix=PREFIX)
        the_store.create_schema()
    yield the_store
    the_store.close()


@pytest.fixture(params=["redis", "memcached", CLUSTER])
def shared_cache_url(request: pytest.FixtureRequest) -> str:
    """The URL of each cache that processes share."""
    return cache_url_of(request, request.param)


@pytest.fixture
def cache(cache_url: str) -> Iterator[Cache]:
    the_cache = open_cache(cache_url)
    yield the_cache
    the_cache.close()


@pytest.fixture
def kit(store_url: str, cache_url: str) -> Iterator[shardkit.Kit]:
    with Target(store_url, cache_url).connect() as the_kit:
        yield the_kit


@pytest.fixture
def shared_kit(store_url: str, shared_cache_url: str) -> Iterator[shardkit.Kit]:
    """A kit on every store and each cache that processes share."""
    with Target(store_url, shared_cache_url).connect() as the_kit:
        yield the_kit


@pytest.fixture
def big(store_url: str, cache_url: str) -> Iterator[shardkit.Kit]:
    """A kit on tables of its own, dropped after the test: the huge values counted there
    would widen other tests' ``shardkit list`` tables."""
    with Target(store_url, cache_url, prefix=f"{PREFIX}big_").connect() as the_kit:
        yield the_kit
        the_kit.store.metadata.drop_all(the_kit.store.engine)  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def own_redis() -> Iterator[str]:
    """The URL of a redis-server of this worker's own, started on first use and reused:
    for the tests that wipe their cache (``FLUSHDB``), which must not wipe what tests in
    other workers keep in the shared server."""
    from servers import RedisServer, running

    with running(RedisServer) as server:
        yield server.url


@pytest.fixture
def cutter() -> Iterator[tuple[Cutter, str]]:
    """A cutting proxy (``servers.Cutter``) in front of the tests' Redis, and the URL of
    its database there."""
    from urllib.parse import urlsplit

    from servers import Cutter

    require(REDIS)
    where = urlsplit(REDIS)
    proxy = Cutter(where.hostname or "127.0.0.1", where.port or 6379)
    yield proxy, where._replace(netloc=f"127.0.0.1:{proxy.port}").geturl()
    proxy.close()


@pytest.fixture(scope="session")
def own_memcached() -> Iterator[str]:
    """The URL of a memcached of this worker's own, started on first use and reused."""
    from servers import MemcachedServer, running

    with running(MemcachedServer) as server:
        yield server.url


@pytest.fixture(params=["memory", "redis", "memcached", CLUSTER])
def own_cache_url(request: pytest.FixtureRequest) -> str:
    """Each cache, the shared ones on servers this worker has to itself: for tests that
    count the commands a server received (its statistics are server-wide)."""
    if request.param == "memory":
        return "memory://"
    if request.param == CLUSTER:
        return cache_url_of(request, CLUSTER)
    return str(request.getfixturevalue(f"own_{request.param}"))


@pytest.fixture
def name() -> str:
    """A counter name no other test or run uses."""
    return f"test:{uuid.uuid4().hex}"
