"""An example Django site using shardkit: videos with sharded and buffered counts.

Its "default" database is a SQLite file; a "postgres" database is configured too when
its server answers (always under CI=true, so that CI fails loudly without it), which
is how the tests run everything on both.
"""

from __future__ import annotations

import os
import socket
import tempfile
import uuid
from pathlib import Path
from urllib.parse import urlsplit

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-site-only-not-a-secret")
DEBUG = True
ALLOWED_HOSTS = ["localhost", "127.0.0.1", "testserver"]
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
ROOT_URLCONF = "django_site.urls"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "shardkit.contrib.django",
    "videos",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

# The test databases are named for the test run (subprocesses inherit it), so that runs
# at the same time on one server never meet.
_TEST_RUN = os.environ.setdefault("SHARDKIT_DJANGO_TEST_RUN", uuid.uuid4().hex[:8])

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": BASE_DIR / "db.sqlite3",
        # Writers take the write lock when their transaction begins, and wait for it.
        "OPTIONS": {
            "transaction_mode": "IMMEDIATE",
            "timeout": 30,
            "init_command": "PRAGMA journal_mode=WAL;",
        },
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

SHARDKIT = {
    "STORE": "default",
    "CACHE": os.environ.get("SHARDKIT_CACHE", "memory://"),
    # "EXECUTOR": "django_site.celery:app",  # shardkit's tasks on Celery workers
}
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/14")
