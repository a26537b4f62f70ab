"""The model of the counters table for the admin: state only (the table is the store's;
``managed = False``), named with ``SHARDKIT['PREFIX']`` as the model is."""

from __future__ import annotations

from django.db import migrations, models

import shardkit.contrib.django.models
from shardkit.contrib.django.conf import options


class Migration(migrations.Migration):
    dependencies = [("shardkit", "0003_range_tries")]
    operations = [
        migrations.CreateModel(
            name="Counter",
            fields=[
                (
                    "name",
                    shardkit.contrib.django.models.NameField(
                        max_length=200, primary_key=True, serialize=False
                    ),
                ),
                ("kind", models.CharField(max_length=16)),
                ("shards", models.IntegerField()),
                ("incarnation", models.BigIntegerField()),
            ],
            options={
                "db_table": f"{options()['PREFIX']}counters",
                "ordering": ("name",),
                "managed": False,
            },
        ),
    ]
