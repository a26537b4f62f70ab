"""The site's Celery app. With ``SHARDKIT["EXECUTOR"] = "django_site.celery:app"``,
shardkit's background tasks (flushes, map ranges) run on its workers:
``celery -A django_site worker``."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "django_site.settings")

app = Celery("django_site")
app.config_from_object("django.conf:settings", namespace="CELERY")
