"""The README's model."""

from django.db import models

from shardkit.contrib.django import CountingQuerySet, ShardedCount


class Video(models.Model):
    title = models.CharField(max_length=200)
    views = ShardedCount(shards=20)  # a sharded counter per video
    likes = ShardedCount(buffered=True, interval=5)  # a buffered one
    objects = CountingQuerySet.as_manager()
