"""The example site's settings as the tests run it (``DJANGO_SETTINGS_MODULE``).

The test databases are named for the test run (subprocesses inherit the name), so that
runs at the same time on one server never meet; a "postgres" database is configured
beside the SQLite "default" when its server answers (always under CI=true, so that CI
fails loudly without it), which is how the tests run everything on both.
"""

from __future__ import annotations

import os
import socket
import tempfile
import uuid
from pathlib import Path
from urllib.parse import urlsplit

from django_site.settings import *  # noqa: F403  (the site as its users run it)
from django_site.settings import DATABASES

_TEST_RUN = os.environ.setdefault("SHARDKIT_DJANGO_TEST_RUN", uuid.uuid4().hex[:8])

DATABASES = {
    "default": {
        **DATABASES["default"],
        "TEST": {"NAME": Path(tempfile.gettempdir()) / f"shardkit-django-{_TEST_RUN}.sqlite3"},
    },
}

_POSTGRES = urlsplit(
    os.environ.get("SHARDKIT_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
)


def _answers(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
    except OSError:
        return False
    return True


if os.environ.get("CI", "").lower() == "true" or _answers(
    _POSTGRES.hostname or "127.0.0.1", _POSTGRES.port or 5432
):
    DATABASES["postgres"] = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _POSTGRES.path.lstrip("/") or "test",
        "USER": _POSTGRES.username or "postgres",
        "PASSWORD": _POSTGRES.password or "",
        "HOST": _POSTGRES.hostname or "127.0.0.1",
        "PORT": _POSTGRES.port or 5432,
        "TEST": {"NAME": f"test_shardkit_django_{_TEST_RUN}"},
    }
