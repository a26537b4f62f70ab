"""The Django app: ``INSTALLED_APPS += ["shardkit.contrib.django"]``."""

from __future__ import annotations

from django.apps import AppConfig
from django.core import checks
from django.core.signals import setting_changed
from django.db.backends.signals import connection_created
from django.db.models.signals import post_migrate


class ShardkitConfig(AppConfig):
    """Builds the kit from ``settings.SHARDKIT`` when Django is ready (reaching no
    server), and again whenever a test overrides that setting; checks that models with
    counts have a counting manager (``shardkit.E001``); watches the deletes of models whose
    counts take objects seen to exist (``exists_ttl``) as existing; finds out whether each
    connection to the store's database goes through a pooler, when it is opened (counting
    statements run prepared where none is); lets ``kit.map`` take querysets. Its
    migrations create shardkit's tables in the database ``SHARDKIT['STORE']``, and every
    ``migrate`` creates those of them that are missing (a changed prefix, a table new in
    this version); the check ``shardkit.W001`` names missing tables (see ``schema``)."""

    name = "shardkit.contrib.django"
    label = "shardkit"
    verbose_name = "shardkit"

    def ready(self) -> None:
        from shardkit.mapper.source import adapt_sources

        from .conf import configure, reconfigure
        from .querysets import check_managers
        from .schema import check_tables, create_missing_tables
        from .sightings import watch_deletes
        from .source import adapt_queryset
        from .statements import note_pooler

        configure()
        adapt_sources(adapt_queryset)
        watch_deletes()
        setting_changed.connect(reconfigure, dispatch_uid="shardkit.reconfigure")
        connection_created.connect(note_pooler, dispatch_uid="shardkit.note_pooler")
        post_migrate.connect(
            create_missing_tables, sender=self, dispatch_uid="shardkit.create_missing_tables"
        )
        checks.register(check_managers, checks.Tags.models)
        checks.register(check_tables, checks.Tags.database)
