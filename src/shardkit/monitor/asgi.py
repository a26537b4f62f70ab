"""The dashboard as an ASGI application (Starlette): ``shardkit dashboard`` serves it;
any ASGI project can mount it (``app.mount("/shardkit", dashboard(kit))``).

Routes (relative to where it is mounted): ``/`` the page; ``/api/info``,
``/api/counters?prefix=&limit=``, ``/api/jobs``, ``/api/jobs/{id}`` (JSON, read-only);
``POST /api/jobs/{id}/cancel`` and ``/resume`` (with the token); ``/metrics`` (when
prometheus_client is installed). Its endpoints read the kit from a thread pool: the
event loop is never blocked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from shardkit.errors import MissingDriver

from .report import PAGE_HEADERS, Monitor

if TYPE_CHECKING:
    from shardkit.kit import Kit


def dashboard(
    kit: Kit, *, token: str | None = None, refresh: float = 1.0, counters: Sequence[str] = ()
) -> Any:
    """A Starlette app showing ``kit``'s counters and jobs, refreshed every ``refresh``
    seconds; read-only unless ``token`` (16 characters or more) is given, which cancel
    and resume then require. ``/metrics`` lists ``counters``' values (see
    ``KitCollector``)."""
    try:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import HTMLResponse, JSONResponse, Response
        from starlette.routing import Route
    except ImportError as exc:
        raise MissingDriver(
            "the dashboard needs Starlette: pip install 'shardkit[dashboard]'"
        ) from exc
    monitor = Monitor(kit, token=token, refresh=refresh)

    def answer(read: Callable[[Request], tuple[int, Any]]) -> Callable[[Request], Response]:
        def endpoint(request: Request) -> Response:
            status, body = read(request)
            return JSONResponse(body, status, headers={"Cache-Control": "no-store"})

        return endpoint

    def page(request: Request) -> Response:
        return HTMLResponse(monitor.page(), headers=PAGE_HEADERS)

    routes = [
        Route("/", page),
        Route("/api/info", answer(lambda request: monitor.info())),
        Route(
            "/api/counters",
            answer(
                lambda request: monitor.counters(
                    request.query_params.get("prefix", ""),
                    request.query_params.get("limit", "200"),
                )
            ),
        ),
        Route("/api/jobs", answer(lambda request: monitor.jobs())),
        Route("/api/jobs/{job}", answer(lambda request: monitor.job(request.path_params["job"]))),
        Route(
            "/api/jobs/{job}/{action}",
            answer(
                lambda request: monitor.act(
                    request.path_params["job"],
                    request.path_params["action"],
                    request.headers.get("authorization"),
                )
            ),
            methods=["POST"],
        ),
    ]
    try:
        from .exporter import exposition, registry

        collected = registry(kit, counters)
    except MissingDriver:
        pass  # no prometheus_client: no /metrics
    else:

        def metrics(request: Request) -> Response:
            body, content_type = exposition(collected, request.headers.get("accept"))
            return Response(body, headers={"Content-Type": content_type})

        routes.append(Route("/metrics", metrics))
    return Starlette(routes=routes)
