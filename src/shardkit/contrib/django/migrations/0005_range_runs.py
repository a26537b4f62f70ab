"""A range's ``runs`` (runs begun since its job was last resumed), for mapper tables made
before it (new ones have it)."""

from __future__ import annotations

from django.db import migrations

from shardkit.contrib.django.schema import add_missing_columns


class Migration(migrations.Migration):
    dependencies = [("shardkit", "0004_counter")]
    operations = [migrations.RunPython(add_missing_columns, migrations.RunPython.noop)]
