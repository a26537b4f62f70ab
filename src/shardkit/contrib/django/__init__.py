"""shardkit for Django: counts on models through the ORM, querysets as mapping sources.

::

    # settings.py
    INSTALLED_APPS += ["shardkit.contrib.django"]
    SHARDKIT = {"STORE": "default", "CACHE": "redis://localhost:6379/0"}

    # models.py
    from shardkit.contrib.django import CountingQuerySet, ShardedCount

    class Video(models.Model):
        views = ShardedCount()
        objects = CountingQuerySet.as_manager()

Then ``manage.py migrate`` creates shardkit's tables in the ``STORE`` database, and
``kit()`` is the app's kit (``kit().map(queryset, fn)``, ``kit().sharded(name)``, …).
Importing this package reads no setting and reaches no server.
"""

from .conf import kit
from .counts import BoundCount, NotACountingUpdate, ShardedCount
from .querysets import CountingQuerySet

__all__ = ["BoundCount", "CountingQuerySet", "NotACountingUpdate", "ShardedCount", "kit"]
