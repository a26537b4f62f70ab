"""A range's ``tries`` (failed attempts since its last page), for mapper tables made
before it (new ones have it)."""

from __future__ import annotations

from django.db import migrations

from shardkit.contrib.django.schema import add_missing_columns


class Migration(migrations.Migration):
    dependencies = [("shardkit", "0002_range_planned")]
    operations = [migrations.RunPython(add_missing_columns, migrations.RunPython.noop)]
