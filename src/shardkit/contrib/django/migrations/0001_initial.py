"""shardkit's tables (counters, shards, keys, flushed, maxima, jobs, ranges), named with
``SHARDKIT['PREFIX']`` and defined once, by the store itself."""

from __future__ import annotations

from typing import Any

from django.db import migrations

from shardkit.contrib.django.conf import migration_store


def create_tables(apps: Any, schema_editor: Any) -> None:
    migration_store(schema_editor).create_schema()


def drop_tables(apps: Any, schema_editor: Any) -> None:
    store = migration_store(schema_editor)
    store.metadata.drop_all(store.engine)


class Migration(migrations.Migration):
    initial = True
    operations = [migrations.RunPython(create_tables, drop_tables)]
