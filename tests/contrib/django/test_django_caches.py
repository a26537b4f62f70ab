"""``SHARDKIT["CACHE"]`` naming an entry of ``CACHES``: the kit shares that Redis cache's
client (Django's own ``RedisCache`` and django-redis), and counts through it; an entry
that is not there, or not Redis, is refused when the settings are read."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.cache import caches
from django.core.exceptions import ImproperlyConfigured
from django.db.models import F

from backends import REDIS, require
from shardkit.contrib.django import kit
from videos.models import Video

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

BACKENDS = {
    "django": "django.core.cache.backends.redis.RedisCache",
    "django-redis": "django_redis.cache.RedisCache",
}


def pool_of(backend: str) -> Any:
    """The connection pool the CACHES entry ``shared`` writes through."""
    cache: Any = caches["shared"]
    if backend == "django":
        return cache._cache._get_connection_pool(write=True)
    return cache.client.get_client(write=True).connection_pool


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_the_cache_may_be_an_entry_of_caches(backend: str, database: str, settings: Any) -> None:
    require(REDIS)
    settings.CACHES = {
        **settings.CACHES,
        "shared": {"BACKEND": BACKENDS[backend], "LOCATION": REDIS},
    }
    settings.SHARDKIT = {**settings.SHARDKIT, "CACHE": "shared"}
    cache: Any = kit().cache
    assert cache._client.connection_pool is pool_of(backend)
    video = Video.objects.create(title="shared")
    Video.objects.filter(pk=video.pk).update(views=F("views") + 3, likes=F("likes") + 2)
    assert video.views.value(fresh=True) == 3
    assert video.likes.counter.parts() == (0, 2)  # pending in the shared Redis
    video.likes.counter.flush()
    assert video.likes.counter.parts() == (2, 0)
    kit().close()
    caches["shared"].set("still", "open")  # the kit closed nothing of Django's
    assert caches["shared"].get("still") == "open"


def test_a_cache_entry_that_is_missing_or_not_redis_is_refused(settings: Any) -> None:
    with pytest.raises(ImproperlyConfigured, match=r"entry of CACHES \('default'\), not 'nowhere'"):
        settings.SHARDKIT = {**settings.SHARDKIT, "CACHE": "nowhere"}
    settings.CACHES = {
        **settings.CACHES,
        "local": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    }
    with pytest.raises(ImproperlyConfigured, match=r"LocMemCache .*client of a Redis cache"):
        settings.SHARDKIT = {**settings.SHARDKIT, "CACHE": "local"}
