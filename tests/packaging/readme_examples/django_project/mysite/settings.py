"""The smallest project with the README's Django settings, run by a clean install of
``shardkit[django]``: SQLite, and the in-process cache (a Redis cache would need
``shardkit[redis]`` too)."""

from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = "readme-example-only"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = ["videos"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": BASE_DIR / "db.sqlite3",
        "OPTIONS": {"transaction_mode": "IMMEDIATE"},
    }
}

# The README's lines:
INSTALLED_APPS += ["shardkit.contrib.django"]
SHARDKIT = {"STORE": "default", "CACHE": "memory://", "EXECUTOR": None}
