"""When this process last saw objects exist, so that a buffered count's update by key
need not read them again within ``exists_ttl`` (``ShardedCount``)."""

from __future__ import annotations

import threading
import time
from typing import Any

from django.db import models, transaction

from .counts import counts_of


class Sightings:
    """When this process last saw objects exist, for counts with ``exists_ttl``: by
    database alias, model label and key (the newest ``most``). Thread-safe."""

    def __init__(self, most: int = 100_000) -> None:
        self._seen: dict[tuple[str, str, Any], float] = {}  # oldest first
        self._most = most
        self._lock = threading.Lock()

    def saw(self, seen: tuple[str, str, Any]) -> None:
        with self._lock:
            self._seen.pop(seen, None)
            self._seen[seen] = time.monotonic()
            if len(self._seen) > self._most:
                del self._seen[next(iter(self._seen))]

    def within(self, seen: tuple[str, str, Any], ttl: float) -> bool:
        at = self._seen.get(seen)
        return at is not None and time.monotonic() - at <= ttl

    def forget(
        self, sender: type[models.Model], instance: models.Model, using: str, **_: Any
    ) -> None:
        """``post_delete``'s receiver: forget the object now and when the delete commits
        (an update that read it meanwhile may have seen it)."""
        seen = (using, sender._meta.label_lower, instance.pk)
        self._forget(seen)
        transaction.on_commit(lambda: self._forget(seen), using=using)

    def _forget(self, seen: tuple[str, str, Any]) -> None:
        with self._lock:
            self._seen.pop(seen, None)


sightings = Sightings()


def watch_deletes() -> None:
    """Forget the objects deleted through the ORM of models whose counts have
    ``exists_ttl`` (connected once Django's models are loaded: a model inherits the
    counts of an abstract one)."""
    from django.apps import apps
    from django.db.models.signals import post_delete

    for model in apps.get_models():
        if any(count.exists_ttl for count in counts_of(model).values()):
            post_delete.connect(
                sightings.forget,
                sender=model,
                weak=False,
                dispatch_uid=f"shardkit.sightings.{model._meta.label_lower}",
            )


__all__ = ["Sightings", "sightings", "watch_deletes"]
