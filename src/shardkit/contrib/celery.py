"""The Celery executor: a kit's background tasks as registered Celery tasks.

Build the kit in the module that defines the Celery app, so the worker (which imports
that module) has the same kit with the same tasks::

    app = Celery("proj", broker="redis://…")
    kit = shardkit.connect(store=…, cache="redis://…", executor=CeleryExecutor(app))

and run ``celery -A proj worker``. Every shardkit task is named ``shardkit.<task>``
(route them with ``task_routes={"shardkit.*": {"queue": …}}``), takes JSON arguments
only, and is acknowledged late: a worker killed while running one gets it redelivered.
That is safe because shardkit's tasks are idempotent.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from shardkit import _urls
from shardkit.errors import BackendError, ConfigurationError
from shardkit.executor.base import Marks, Task, Timing, When

if TYPE_CHECKING:
    from typing_extensions import Unpack


class CeleryExecutor:
    """Submits tasks to a Celery app's broker; its workers run them.

    ``close()`` does nothing: submitted tasks are in the broker, and the app is the
    caller's to close.
    """

    def __init__(self, app: Any, *, queue: str | None = None) -> None:
        self.app = app
        self.queue = queue
        self.url = f"celery://{app.main or 'app'}"
        self._tasks: Mapping[str, Task] = {}
        self._marks: Marks | None = None

    def __repr__(self) -> str:
        return f"<CeleryExecutor {self.url}>"

    def bind(self, tasks: Mapping[str, Task], marks: Marks) -> None:
        self._tasks = tasks
        self._marks = marks
        for name in tasks:
            self.app.task(
                self._runner(name),
                name=f"shardkit.{name}",
                serializer="json",
                acks_late=True,
                reject_on_worker_lost=True,
                ignore_result=True,
                shared=False,  # registered on this app only
            )

    def _runner(self, name: str) -> Any:
        def run(**args: Any) -> None:
            self._tasks[name](args)

        run.__name__ = run.__qualname__ = f"shardkit_{name}"
        run.__module__ = __name__
        return run

    def submit(self, task: str, args: Mapping[str, Any], **when: Unpack[When]) -> bool:
        delay, dedupe, window, _ = Timing(**when)
        # ``merge`` is not used: the queue is the broker's. Due ``delay`` seconds from
        # this call, not from when the broker is reached: a first submission connects
        # first, which may take a good part of a second.
        due = datetime.now(timezone.utc) + timedelta(seconds=delay) if delay > 0 else None
        if task not in self._tasks or self._marks is None:
            raise ConfigurationError(f"no task named {task!r} is bound to {self.url}")
        if dedupe is not None and not self._marks.claim(dedupe, max(delay, 0.0) + window):
            return False
        try:
            self.app.send_task(
                f"shardkit.{task}",
                kwargs=dict(args),
                eta=due,
                serializer="json",
                queue=self.queue,
            )
        except Exception as exc:  # kombu's and the transports' errors share no base
            if dedupe is not None:
                self._marks.release(dedupe)
            password = urlsplit(str(self.app.conf.broker_url or "")).password
            detail = _urls.scrub(f"{type(exc).__name__}: {exc}", password)
            raise BackendError(f"{self.url} could not submit {task!r}: {detail}") from exc
        return True

    def close(self) -> None:
        return None


__all__ = ["CeleryExecutor"]
