"""The Django app: ``INSTALLED_APPS += ["shardkit.contrib.django"]``."""

from __future__ import annotations

from django.apps import AppConfig
from django.core import checks
from django.core.signals import setting_changed


class ShardkitConfig(AppConfig):
    """Builds the kit from ``settings.SHARDKIT`` when Django is ready (reaching no
    server), and again whenever a test overrides that setting; checks that models with
    counts have a counting manager (``shardkit.E001``). Its migrations create shardkit's
    tables in the database ``SHARDKIT['STORE']``."""

    name = "shardkit.contrib.django"
    label = "shardkit"
    verbose_name = "shardkit"

    def ready(self) -> None:
        from .conf import configure, reconfigure
        from .counts import check_managers

        configure()
        setting_changed.connect(reconfigure, dispatch_uid="shardkit.reconfigure")
        checks.register(check_managers, checks.Tags.models)
