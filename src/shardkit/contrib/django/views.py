"""The dashboard and the Prometheus metrics in a Django project::

    # urls.py
    path("shardkit/", include("shardkit.contrib.django.urls")),

The page is ``shardkit/``, its JSON API ``shardkit/api/…``, the metrics
``shardkit/metrics``. They show counter names and values to whoever reaches them: put
them behind the project's own access control. Read-only unless
``SHARDKIT["DASHBOARD_TOKEN"]`` is set; ``SHARDKIT["METRICS_COUNTERS"]`` lists the
counters whose values the metrics export.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from shardkit.errors import ShardkitError
from shardkit.monitor.exporter import KitCollector, exposition, registry
from shardkit.monitor.report import PAGE_HEADERS, Monitor

from .conf import kit, options

if TYPE_CHECKING:
    from shardkit.kit import Kit


def _monitor() -> Monitor:
    try:
        return Monitor(kit(), token=options()["DASHBOARD_TOKEN"])
    except ShardkitError as exc:
        raise ImproperlyConfigured(f"settings.SHARDKIT: {exc}") from exc


def _json(answer: tuple[int, Any]) -> JsonResponse:
    status, body = answer
    return JsonResponse(body, status=status, headers={"Cache-Control": "no-store"})


@require_GET
def page(request: HttpRequest) -> HttpResponse:
    return HttpResponse(Monitor.page(), headers=PAGE_HEADERS)


@require_GET
def info(request: HttpRequest) -> JsonResponse:
    return _json(_monitor().info())


@require_GET
def counters(request: HttpRequest) -> JsonResponse:
    query = request.GET
    return _json(_monitor().counters(query.get("prefix", ""), query.get("limit", "200")))


@require_GET
def jobs(request: HttpRequest) -> JsonResponse:
    return _json(_monitor().jobs())


@require_GET
def job(request: HttpRequest, job: str) -> JsonResponse:
    return _json(_monitor().job(job))


@csrf_exempt  # authorised by the token in a header, never by a cookie
@require_POST
def act(request: HttpRequest, job: str, action: str) -> JsonResponse:
    return _json(_monitor().act(job, action, request.headers.get("Authorization")))


@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    """Prometheus metrics: every process's under ``$PROMETHEUS_MULTIPROC_DIR`` (set it
    for gunicorn's workers), and the kit's jobs and counters read at each scrape."""
    collected = _registry(kit(), tuple(options()["METRICS_COUNTERS"]))
    body, content_type = exposition(collected, request.headers.get("Accept"))
    return HttpResponse(body, content_type=content_type)


class _DjangoReads(KitCollector):
    """A ``KitCollector`` whose reads, each in a thread of its own, close that thread's
    database connections when they end, as a request's are closed."""

    def _read(self) -> list[Any]:
        try:
            return super()._read()
        finally:
            connections.close_all()


@functools.lru_cache(maxsize=1)
def _registry(the_kit: Kit, counters: Sequence[str]) -> Any:
    """The registry of the app's kit, kept from scrape to scrape: a scrape whose read of
    the store is late serves the last reading, and waits for the read in flight rather
    than begin another."""
    collected = registry(None)
    collected.register(_DjangoReads(the_kit, counters))
    return collected
