"""A FastAPI service that counts a hot item with shardkit's async kit.

    pip install -e '.[aio,postgres,redis,metrics]' fastapi uvicorn
    cd examples/fastapi_app
    SHARDKIT_STORE=postgresql://localhost/test SHARDKIT_CACHE=redis://localhost/0 \\
        uvicorn service:app

* ``POST /items/{item}/view`` counts a view on the item's sharded counter (exact, one
  upsert per request, or fewer: concurrent requests share statements); an
  ``Idempotency-Key`` header makes a retried request count once.
* ``POST /items/{item}/hit`` counts a hit on its buffered counter (one Redis command; the
  store gets the hits once a second, flushed on the event loop).
* ``GET /counts?item=a&item=b`` reads many items' counts: one cache read and one store
  query for the views, one of each for the hits.
* ``GET /metrics``: Prometheus metrics of the service's writes and flushes.

Without the two variables it runs on the embedded default (``sqlite:///shardkit.db``,
``memory://``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import FastAPI, Header, Query, Request
from fastapi.responses import JSONResponse, Response

import shardkit
import shardkit.aio
from shardkit.monitor.exporter import exposition, registry

SHARDS = 32  # concurrent writers (processes) one item's views spread over
FLUSH_EVERY = 1.0  # seconds between flushes of an item's hits to the store


def create_app(
    store: str | None = None, cache: str | None = None, prefix: str = "shardkit_"
) -> FastAPI:
    """The service on ``store`` and ``cache`` (default: ``$SHARDKIT_STORE`` and
    ``$SHARDKIT_CACHE``, or the embedded default); its kit opens with the app's lifespan
    and closes with it (flushing what is pending)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with shardkit.aio.connect(store, cache, prefix=prefix) as kit:
            app.state.kit = kit
            yield

    app = FastAPI(title="shardkit counting service", lifespan=lifespan)

    @app.exception_handler(shardkit.ValidationError)
    async def refused(request: Request, exc: shardkit.ValidationError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=400)

    @app.post("/items/{item}/view")
    async def view(
        item: str,
        request: Request,
        idempotency_key: Annotated[str | None, Header()] = None,
    ) -> dict[str, bool]:
        """Count a view of ``item``; ``counted`` is False for a repeated key."""
        kit: shardkit.aio.AsyncKit = request.app.state.kit
        views = await kit.sharded(f"views:{item}", shards=SHARDS)
        return {"counted": await views.incr(key=idempotency_key)}

    @app.post("/items/{item}/hit")
    async def hit(item: str, request: Request) -> dict[str, bool]:
        """Count a hit of ``item``, in the cache first."""
        kit: shardkit.aio.AsyncKit = request.app.state.kit
        hits = await kit.buffered(f"hits:{item}", interval=FLUSH_EVERY)
        await hits.incr()
        return {"counted": True}

    @app.get("/counts")
    async def counts(
        request: Request, item: Annotated[list[str], Query()]
    ) -> dict[str, dict[str, int]]:
        """Views (cached, this process's own writes included) and hits (exact) of each
        ``item``."""
        kit: shardkit.aio.AsyncKit = request.app.state.kit
        views = await kit.values([f"views:{name}" for name in item])
        hits = await kit.parts([f"hits:{name}" for name in item])
        return {
            name: {"views": views[f"views:{name}"], "hits": hits[f"hits:{name}"].total}
            for name in item
        }

    @app.get("/metrics")
    def metrics(request: Request) -> Response:
        """Prometheus metrics of the app's writes and flushes: every worker's, when
        ``$PROMETHEUS_MULTIPROC_DIR`` is set for uvicorn's workers."""
        body, content_type = exposition(registry(None), request.headers.get("accept"))
        return Response(body, media_type=content_type)

    return app


app = create_app()
