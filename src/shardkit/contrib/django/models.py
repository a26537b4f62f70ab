"""The counters as the Django admin shows them (``admin``): a model of the store's
``counters`` table, read only. Django never creates, alters or writes the table
(``managed = False``: the store's own schema does, see ``schema``); the admin deletes
and resets counters through the kit. Its table name takes ``SHARDKIT['PREFIX']`` as
Django starts."""

from __future__ import annotations

from typing import Any

from django.db import models

from shardkit.validation import MAX_NAME_LENGTH

from .conf import options


class NameField(models.CharField):  # type: ignore[type-arg]
    """A counter's name: text, which the column holds as UTF-8 bytes on MySQL."""

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> Any:
        return value.decode() if isinstance(value, bytes) else value


class Counter(models.Model):
    """A counter of the store: its name, kind, shard count and incarnation."""

    name = NameField(max_length=MAX_NAME_LENGTH, primary_key=True)
    kind: models.CharField[str, str] = models.CharField(max_length=16)
    shards: models.IntegerField[int, int] = models.IntegerField()
    incarnation: models.BigIntegerField[int, int] = models.BigIntegerField()

    class Meta:
        managed = False
        db_table = f"{options()['PREFIX']}counters"
        ordering = ("name",)

    def __str__(self) -> str:
        return str(self.name)
