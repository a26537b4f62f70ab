"""shardkit's tables (counters, shards, keys, flushed, maxima, jobs, ranges), named with
``SHARDKIT['PREFIX']`` and defined once, by the store itself."""

from __future__ import annotations

from typing import Any

from django.db import migrations

from shardkit.contrib.django.conf import migration_store
from shardkit.contrib.django.schema import create_tables, shardkit_tables


def create(apps: Any, schema_editor: Any) -> None:
    create_tables(migration_store(schema_editor))


def drop(apps: Any, schema_editor: Any) -> None:
    store = migration_store(schema_editor)
    for table in reversed(shardkit_tables(store)):
        table.drop(store.engine, checkfirst=True)


class Migration(migrations.Migration):
    initial = True
    operations = [migrations.RunPython(create, drop)]
