"""A model with a sharded count, spelled as every revision since 3afbc35 spells it."""

from __future__ import annotations

from django.db import models

from compare_app import SHARDS
from shardkit.contrib.django import CountingQuerySet, ShardedCount


class Hit(models.Model):
    """An object whose ``views`` the writers count with ``update(views=F("views") + 1)``."""

    views = ShardedCount(shards=SHARDS)

    objects: models.Manager[Hit] = CountingQuerySet.as_manager()

    class Meta:
        app_label = "compare_app"
