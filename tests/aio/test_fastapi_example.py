"""The example service through its ASGI app (httpx's ASGI transport, the app's lifespan
run around each test), on the embedded default and on PostgreSQL + Redis: concurrent
requests count exactly, keys count once, bad input counts nothing."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TypeVar

import httpx
import pytest

import shardkit.metrics
from backends import CACHE_URLS, PREFIX, STORE_URLS, require
from service import create_app

T = TypeVar("T")


@pytest.fixture(params=["embedded", "postgres+redis"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    if request.param == "embedded":
        return f"sqlite:///{tmp_path / 'service.db'}", "memory://"
    store, cache = STORE_URLS["postgres"], CACHE_URLS["redis"]
    assert store is not None
    require(store)
    require(cache)
    return store, cache


@asynccontextmanager
async def client(where: tuple[str, str]) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the service, with its lifespan (the kit) open around it."""
    app = create_app(*where, prefix=PREFIX)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://service") as c:
            yield c


def run(where: tuple[str, str], work: Callable[[httpx.AsyncClient], Awaitable[T]]) -> T:
    async def main() -> T:
        async with client(where) as c:
            return await work(c)

    return asyncio.run(main())


def test_concurrent_views_and_hits_count_exactly(where: tuple[str, str]) -> None:
    item = uuid.uuid4().hex

    async def work(c: httpx.AsyncClient) -> dict[str, int]:
        replies = await asyncio.gather(
            *(c.post(f"/items/{item}/view") for _ in range(200)),
            *(c.post(f"/items/{item}/hit") for _ in range(150)),
        )
        assert all(reply.status_code == 200 for reply in replies)
        counts = await c.get("/counts", params={"item": [item, "other-" + item]})
        assert counts.json()["other-" + item] == {"views": 0, "hits": 0}
        return dict(counts.json()[item])

    assert run(where, work) == {"views": 200, "hits": 150}
    # Closed and opened again: the hits were flushed to the store, the views are there.
    fresh = run(where, lambda c: c.get("/counts", params={"item": item}))
    assert fresh.json() == {item: {"views": 200, "hits": 150}}


def test_a_repeated_idempotency_key_counts_once(where: tuple[str, str]) -> None:
    item = uuid.uuid4().hex

    async def work(c: httpx.AsyncClient) -> list[bool]:
        headers = {"Idempotency-Key": f"req-{item}"}
        replies = await asyncio.gather(
            *(c.post(f"/items/{item}/view", headers=headers) for _ in range(5))
        )
        counts = await c.get("/counts", params={"item": item})
        assert counts.json()[item]["views"] == 1
        return sorted(reply.json()["counted"] for reply in replies)

    assert run(where, work) == [False, False, False, False, True]


def test_a_bad_item_is_refused_and_counts_nothing(where: tuple[str, str]) -> None:
    async def work(c: httpx.AsyncClient) -> tuple[int, int]:
        long = "x" * 1000
        view = await c.post(f"/items/{long}/view")
        hit = await c.post(f"/items/{long}/hit")
        return view.status_code, hit.status_code

    assert run(where, work) == (400, 400)


def test_the_metrics_count_the_services_writes(where: tuple[str, str]) -> None:
    shardkit.metrics.enable()  # as opening a kit does
    item = uuid.uuid4().hex

    def applied(text: str, kind: str) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "shardkit_write_seconds_count"
            and sample.labels == {"kind": kind, "outcome": "applied"}
        )

    async def work(c: httpx.AsyncClient) -> tuple[float, float]:
        before = (await c.get("/metrics")).text
        await asyncio.gather(*(c.post(f"/items/{item}/view") for _ in range(30)))
        await asyncio.gather(*(c.post(f"/items/{item}/hit") for _ in range(20)))
        after = (await c.get("/metrics")).text
        return (
            applied(after, "sharded") - applied(before, "sharded"),
            applied(after, "buffered") - applied(before, "buffered"),
        )

    assert run(where, work) == (30, 20)


def test_each_request_looks_up_fastapis_tracer_provider(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stated limit (the example's README): with FastAPI's defaults, its native
    telemetry looks up OpenTelemetry's global tracer provider on every request, a
    request that counts nothing too; ``FastAPI(telemetry={"tracing": False, …})`` does
    not."""
    from fastapi import FastAPI
    from opentelemetry import trace

    looked_up: list[object] = []
    real = trace.get_tracer_provider

    def counted() -> trace.TracerProvider:
        looked_up.append(None)
        return real()

    monkeypatch.setattr(trace, "get_tracer_provider", counted)
    where = (f"sqlite:///{tmp_path / 'service.db'}", "memory://")

    async def refused(c: httpx.AsyncClient) -> list[int]:
        return [(await c.post(f"/items/{'x' * 1000}/hit")).status_code for _ in range(5)]

    assert run(where, refused) == [400] * 5  # nothing counted
    assert len(looked_up) == 5

    looked_up.clear()
    quiet = FastAPI(telemetry={"tracing": False, "metrics": False, "logs": False})
    quiet.get("/")(lambda: {})

    async def requested() -> int:
        transport = httpx.ASGITransport(app=quiet)
        async with httpx.AsyncClient(transport=transport, base_url="http://quiet") as c:
            return (await c.get("/")).status_code

    assert asyncio.run(requested()) == 200
    assert looked_up == []
