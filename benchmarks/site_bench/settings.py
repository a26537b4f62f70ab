"""The example site's settings, on the benchmark's PostgreSQL database and cache.

``SHARDKIT_BENCH_DATABASE`` (a PostgreSQL URL), ``SHARDKIT_BENCH_CACHE`` (a cache URL)
and ``SHARDKIT_BENCH_ATOMIC`` (``1``: ``ATOMIC_REQUESTS``) come from the benchmark.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from django_site.settings import *  # noqa: F403  (the site as its users run it)
from django_site.settings import INSTALLED_APPS

_DATABASE = urlsplit(os.environ["SHARDKIT_BENCH_DATABASE"])

DEBUG = False
ROOT_URLCONF = "site_bench.urls"
INSTALLED_APPS = [*INSTALLED_APPS]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _DATABASE.path.lstrip("/"),
        "USER": _DATABASE.username or "postgres",
        "PASSWORD": _DATABASE.password or "",
        "HOST": _DATABASE.hostname or "127.0.0.1",
        "PORT": _DATABASE.port or 5432,
        "CONN_MAX_AGE": None,  # persistent connections, as a deployed site has
        "ATOMIC_REQUESTS": os.environ.get("SHARDKIT_BENCH_ATOMIC") == "1",
    }
}
SHARDKIT = {"STORE": "default", "CACHE": os.environ["SHARDKIT_BENCH_CACHE"]}
