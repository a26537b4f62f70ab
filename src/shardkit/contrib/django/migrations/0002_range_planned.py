"""A range's ``planned`` rows, for mapper tables made before it (new ones have it)."""

from __future__ import annotations

from typing import Any

from django.db import migrations

from shardkit.contrib.django.conf import migration_store


def add_columns(apps: Any, schema_editor: Any) -> None:
    store = migration_store(schema_editor)
    store.transaction("adding missing columns", store.add_missing_columns)


class Migration(migrations.Migration):
    dependencies = [("shardkit", "0001_initial")]
    operations = [migrations.RunPython(add_columns, migrations.RunPython.noop)]
