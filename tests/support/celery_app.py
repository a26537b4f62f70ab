"""The module a real ``celery -A celery_app worker`` imports in the Celery executor's tests.

It is built the way an application builds it: the module that defines the Celery app
also connects the kit, with a ``CeleryExecutor`` on that app, so the worker serves the
kit's tasks. Everything comes from environment variables (see ``Config``), so the test
process, which calls ``build`` with the same ``Config``, has the same kit.

The worker records what it does in the cache's Redis, under the ``record`` key prefix:
``ready`` (the pid of each worker that is ready), ``runs`` (the start and end of every
shardkit task, as JSON) and ``kills`` (every fault, as JSON, written before it strikes).

With ``fault`` set, the kit's ``store.advance`` (the compare-and-set at the heart of a
flush) is wrapped: with probability ``FAULT_PROBABILITY`` a call SIGKILLs the worker, the
first time before the real call, the next time after it, and so on, until ``limit``
kills have struck. ``child:<limit>`` kills the pool process running the task (prefork:
the master lives on and requeues the task); ``worker:<limit>`` kills the whole worker.
"""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import redis
from celery import Celery, current_task, signals
from kombu import Exchange, Queue

import shardkit
from shardkit.contrib.celery import CeleryExecutor
from shardkit.store import Flushed, Store, open_store

ENV = "SHARDKIT_CELERY_"
FAULT_PROBABILITY = 0.5
# A killed worker's unacknowledged tasks come back after this many seconds (Redis
# broker; RabbitMQ requeues them as soon as the connection drops). Every task a healthy
# worker holds, including the ones waiting for their countdown, is acknowledged long
# before: a task held longer would be delivered twice (harmless, tasks are idempotent).
# It exceeds the 5 s a prefork master may take to see that a pool child died, so that
# the task of a killed child comes back through reject_on_worker_lost, not this timeout.
VISIBILITY_TIMEOUT = 10
UNACKED_MUTEX_EXPIRE = 5
QUEUE_EXPIRES = 120.0  # seconds a queue nobody uses lives on (earlier runs' queues go)
BEAT_EVERY = 1.0  # seconds between the beat schedule's flush_all tasks


@dataclass(frozen=True)
class Config:
    """What a worker and the test process need to build the same kit."""

    store: str
    cache: str  # a redis:// URL: the worker also keeps its records there
    prefix: str
    broker: str
    queue: str
    record: str  # key prefix of the records in the cache's Redis
    fault: str = ""  # "", "child:<limit>" or "worker:<limit>"

    def environ(self) -> dict[str, str]:
        return {ENV + field.upper(): value for field, value in asdict(self).items()}

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Config:
        fields = cls.__dataclass_fields__
        return cls(**{f: environ[ENV + f.upper()] for f in fields if ENV + f.upper() in environ})

    def key(self, part: str) -> str:
        return f"{self.record}:{part}"


def make_app(config: Config) -> Celery:
    """The Celery app: one queue of the test's own (which expires when unused, and its
    exchange with it), JSON only, and a low prefetch."""
    app = Celery("shardkit_celery_test", broker=config.broker, set_as_current=False)
    exchange = Exchange(config.queue, auto_delete=True)
    queue = Queue(config.queue, exchange, routing_key=config.queue, expires=QUEUE_EXPIRES)
    app.conf.update(
        task_queues=[queue],
        # The executor must ask for JSON itself: the app's default would be refused.
        task_serializer="pickle",
        accept_content=["json"],
        worker_prefetch_multiplier=1,
        worker_enable_remote_control=False,
        worker_send_task_events=False,
        broker_connection_retry_on_startup=True,
        broker_transport_options={
            "visibility_timeout": VISIBILITY_TIMEOUT,
            # Look for the unacknowledged tasks of a killed worker every second.
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
            # The lock a worker takes to hand them back: one cut off or killed holding
            # it stops every worker's for this long (300 s by default).
            "unacked_mutex_expire": UNACKED_MUTEX_EXPIRE,
        },
        # What the Celery page's beat schedule is, every second (a ``celery beat`` a test
        # starts sends it; workers alone ignore it).
        beat_schedule={
            "shardkit-flush-all": {
                "task": "shardkit.flush_all",
                "schedule": BEAT_EVERY,
                "options": {"queue": config.queue},
            }
        },
    )
    return app


def build(
    config: Config, executor: type[CeleryExecutor] = CeleryExecutor
) -> tuple[Celery, shardkit.Kit]:
    """The app and the kit whose executor submits to it (the fault, if any, installed)."""
    store = open_store(config.store, prefix=config.prefix)
    if config.fault:
        _install_fault(store, config)
    app = make_app(config)
    kit = shardkit.connect(
        store, config.cache, prefix=config.prefix, executor=executor(app, queue=config.queue)
    )
    return app, kit


@functools.cache
def _records(config: Config) -> redis.Redis:
    """The worker's client for its records (redis-py reconnects in a forked child)."""
    return redis.Redis.from_url(config.cache)


def _install_fault(store: Store, config: Config) -> None:
    mode, _, limit_text = config.fault.partition(":")
    if mode not in ("child", "worker"):
        raise ValueError(f"unknown fault {config.fault!r}")
    limit = int(limit_text)
    master = os.getpid()  # the process that imports this module: the worker's master
    real_advance = store.advance

    def kill(when: str, number: int) -> None:
        pid = os.getpid()
        entry = {
            "mode": mode,
            "when": when,
            "number": number,
            "pid": pid,
            "master": master,
            "id": current_task.request.id if current_task else None,
        }
        _records(config).rpush(config.key("kills"), json.dumps(entry))
        if mode == "worker" and pid != master:
            os.kill(master, signal.SIGKILL)
        os.kill(pid, signal.SIGKILL)

    def advance(name: str, generation: int, seen: Flushed, to: Flushed) -> bool:
        # A "child" fault needs a pool child to kill: never the master (a solo pool).
        if random.random() >= FAULT_PROBABILITY or (mode == "child" and os.getpid() == master):
            return real_advance(name, generation, seen, to)
        strike = int(_records(config).incr(config.key(f"faults:{mode}")))  # type: ignore[arg-type]
        if strike > limit:
            return real_advance(name, generation, seen, to)
        if strike % 2 == 1:
            kill("before", strike)
        real_advance(name, generation, seen, to)
        kill("after", strike)
        raise AssertionError("unreachable: the process is dead")

    store.advance = advance  # type: ignore[method-assign]


def _record_run(
    config: Config, event: str, task: Any, task_id: str, kwargs: Any, state: str | None
) -> None:
    if not task.name.startswith("shardkit."):
        return
    request = task.request
    entry = {
        "event": event,
        "state": state,
        "task": task.name,
        "id": task_id,
        "kwargs": kwargs,
        "pid": os.getpid(),
        "at": time.time(),
        "eta": request.eta,
        "redelivered": bool((request.delivery_info or {}).get("redelivered")),
    }
    _records(config).rpush(config.key("runs"), json.dumps(entry))


if ENV + "STORE" in os.environ:  # a worker (or anything) configured by the environment
    config = Config.from_environ(os.environ)
    app, kit = build(config)

    @signals.worker_ready.connect
    def _ready(**_: Any) -> None:
        _records(config).rpush(config.key("ready"), os.getpid())

    @signals.task_prerun.connect
    def _started(task: Any, task_id: str, kwargs: Any = None, **_: Any) -> None:
        _record_run(config, "start", task, task_id, kwargs, None)

    @signals.task_postrun.connect
    def _ended(
        task: Any, task_id: str, kwargs: Any = None, state: str | None = None, **_: Any
    ) -> None:
        _record_run(config, "end", task, task_id, kwargs, state)
