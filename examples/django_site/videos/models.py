"""Videos with a sharded view count and a buffered like count; accounts to map over."""

from django.db import models

from shardkit.contrib.django import CountingQuerySet, ShardedCount


class Video(models.Model):
    title = models.CharField(max_length=200)
    views = ShardedCount()  # sized by its load
    # A counting update of likes by key reads whether the video exists once a minute.
    likes = ShardedCount(buffered=True, interval=1)

    objects = CountingQuerySet.as_manager()

    def __str__(self) -> str:
        return self.title


class Account(models.Model):
    email = models.CharField(max_length=200, unique=True)
    active = models.BooleanField(default=True)
    balance = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return self.email
