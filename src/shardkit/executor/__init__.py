"""Background work: one interface; a local thread pool (the default) and Celery
(``shardkit.contrib.celery``)."""

from shardkit.executor.base import Executor, Marks, Task
from shardkit.executor.local import LocalExecutor

__all__ = ["Executor", "LocalExecutor", "Marks", "Task"]
