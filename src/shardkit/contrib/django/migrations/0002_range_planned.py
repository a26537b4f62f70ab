"""A range's ``planned`` rows, for mapper tables made before it (new ones have it)."""

from __future__ import annotations

from django.db import migrations

from shardkit.contrib.django.schema import add_missing_columns


class Migration(migrations.Migration):
    dependencies = [("shardkit", "0001_initial")]
    operations = [migrations.RunPython(add_missing_columns, migrations.RunPython.noop)]
