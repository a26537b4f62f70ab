"""One endpoint per way of counting a hit on a hot object, and one that does nothing.

Each answers ``ok`` after its update: ``/column/<pk>`` on a plain column,
``/sharded/<pk>`` and ``/buffered/<pk>`` on the video's sharded and buffered counts;
``/likes-incr/<pk>``, the buffered count's ``incr()`` on a video whose key is trusted (no
read); ``/upsert/<pk>``, the sharded count's one statement written by hand (a row per
thread, raw SQL on Django's connection): its ceiling; ``/orm-upsert/<pk>``, the same
after building the queryset and expression of the sharded count's line, as Django does
before any count's code runs (``/orm-incr/<pk>``: the buffered line's, then the trusted-key
``incr()``); and ``/noop``, the framework's ceiling. The site's own
pages stay as they are.
"""

from __future__ import annotations

import os
import threading

from django.db import connection
from django.db.models import F
from django.http import HttpRequest, HttpResponse
from django.urls import include, path

from videos.models import Account, Video


def column(request: HttpRequest, pk: int) -> HttpResponse:
    Account.objects.filter(pk=pk).update(balance=F("balance") + 1)
    return HttpResponse(b"ok")


def sharded(request: HttpRequest, pk: int) -> HttpResponse:
    Video.objects.filter(pk=pk).update(views=F("views") + 1)
    return HttpResponse(b"ok")


def buffered(request: HttpRequest, pk: int) -> HttpResponse:
    Video.objects.filter(pk=pk).update(likes=F("likes") + 1)
    return HttpResponse(b"ok")


def likes_incr(request: HttpRequest, pk: int) -> HttpResponse:
    Video(pk=pk).likes.incr()  # the key is trusted: no read of the object
    return HttpResponse(b"ok")


HITS = "site_bench_hits"  # the upsert endpoint's rows: (slot, n), a slot per thread
UPSERT = (
    f"INSERT INTO {HITS} (slot, n) VALUES (%s, 1) "
    f"ON CONFLICT (slot) DO UPDATE SET n = {HITS}.n + excluded.n"
)


def upsert(request: HttpRequest, pk: int) -> HttpResponse:
    with connection.cursor() as cursor:
        cursor.execute(UPSERT, [f"{os.getpid()}:{threading.get_ident()}"])
    return HttpResponse(b"ok")


def orm_upsert(request: HttpRequest, pk: int) -> HttpResponse:
    """What Django does of the sharded count's line before a count's code runs (its
    queryset and expression built), then the hand-written upsert: the ceiling of any
    count updated through ``update()``."""
    _ = Video.objects.filter(pk=pk), F("views") + 1
    return upsert(request, pk)


def orm_incr(request: HttpRequest, pk: int) -> HttpResponse:
    """The same for the buffered count's line, then its trusted-key ``incr()``."""
    _ = Video.objects.filter(pk=pk), F("likes") + 1
    return likes_incr(request, pk)


def noop(request: HttpRequest) -> HttpResponse:
    return HttpResponse(b"ok")


urlpatterns = [
    path("column/<int:pk>", column),
    path("sharded/<int:pk>", sharded),
    path("buffered/<int:pk>", buffered),
    path("likes-incr/<int:pk>", likes_incr),
    path("upsert/<int:pk>", upsert),
    path("orm-upsert/<int:pk>", orm_upsert),
    path("orm-incr/<int:pk>", orm_incr),
    path("noop", noop),
    path("", include("django_site.urls")),
]
